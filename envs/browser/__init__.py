"""Browser environments: Playwright driving the system Chromium over small web apps the project ships.

- :mod:`envs.browser.apps`: the shop, sign-up form and todo apps (aiohttp on 127.0.0.1) and their server state.
- :mod:`envs.browser.tasks`: tasks, state verifiers and the scripted expert.
- :mod:`envs.browser.pool`: the Chromium launcher and context pool (contexts reused with their state wiped).
- :mod:`envs.browser.env`: ``agentflow/Browser-v0``.

Importing this package imports nothing heavy; Playwright is loaded when a pool first launches a browser.
"""
