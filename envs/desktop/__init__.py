"""Desktop environments: small Tk apps on a private Xvfb display, driven through XTEST, seen through mss.

- :mod:`envs.desktop.apps`: the calculator and text editor (run as their own processes), with a control socket.
- :mod:`envs.desktop.xserver`: the Xvfb server, XTEST input and screenshots.
- :mod:`envs.desktop.tasks`: tasks, state verifiers and the scripted expert.
- :mod:`envs.desktop.env`: ``agentflow/Desktop-v0``.
"""
