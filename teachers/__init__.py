"""The Teacher Manager (on-policy distillation from several teachers): not built yet (issue 10).

It will score student trajectories through any engine's ``score(ids, start, top_k)`` received by injection, so this
package imports nothing of ``agentflow``.
"""
