"""The Teacher Manager: on-policy distillation from several teachers, each serving the data sources routed to it.

- :mod:`teachers.types`: contracts (teacher specs, routes, scoring requests and results, the ``Scorer`` protocol).
- :mod:`teachers.routing`: data-source tags -> a teacher or a weighted mix of teachers.
- :mod:`teachers.teacher`: pre-flight checks (model present, tokenizer identical to the student's) and residency.
- :mod:`teachers.manager`: scoring in per-teacher batches under a budget of resident teachers.

Teachers score through any engine's ``score(ids, start, top_k)`` received by injection (a ``ScorerFactory``), so
this package imports nothing of ``agentflow``.
"""
