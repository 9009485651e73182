"""Recipes: thin programs over :func:`agentflow.builder.build_job` (evaluate -> loop -> evaluate -> summary).

``rl`` (``agentflow train``), ``distill`` (``agentflow distill``, or ``train`` with teachers), ``warmup`` (SFT on a
scripted expert's traces), ``seq_kd`` (the student imitates its teachers' episodes), ``evaluate``
(``agentflow eval`` and held-out success per data source).
"""
