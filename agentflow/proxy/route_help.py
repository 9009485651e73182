"""The proxy's answer to a request it has no route for: a 404 (or 405) that says which path (or method) to use,
instead of a bare "Not Found" (the server writes it in the caller's error shape: Anthropic's for Anthropic clients).

The routes are read from the running app, so a route added to the server is named here without a change. When a
segment of the path is an open trajectory's id, the answer also gives that trajectory's base URL. Base URLs are the
caller's kind: an OpenAI client's ends in ``/v1``, an Anthropic client's does not (the client appends
``/v1/messages``); a caller is an Anthropic client as :func:`~agentflow.proxy.anthropic_wire.wants_anthropic` says.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from aiohttp import web

from agentflow.proxy.anthropic_wire import wants_anthropic
from agentflow.proxy.types import ProxyError

#: How a path parameter of the server's routes is shown to the client.
_SHOWN = {"{tid}": "{trajectory_id}"}
#: Said of an Anthropic client's base URL, which a client set up for OpenAI's would end in ``/v1``.
_APPENDS = " (without /v1: the client appends /v1/messages)"


def served_routes(app: web.Application) -> list[tuple[str, str]]:
    """(method, path pattern) of every route the app serves, as a client should write them (HEAD left out)."""
    out = []
    for route in app.router.routes():
        if route.method in ("HEAD", "*") or route.resource is None:
            continue
        pattern = route.resource.canonical
        for name, shown in _SHOWN.items():
            pattern = pattern.replace(name, shown)
        out.append((route.method, pattern))
    return out


def route_error(
    request: web.Request, exc: web.HTTPException, base_url_of: Callable[[str, bool], str | None]
) -> tuple[ProxyError, dict[str, str]]:
    """The error (and headers) for aiohttp's own ``exc`` on ``request``: which route or method would have served it.

    ``base_url_of(trajectory_id, anthropic)``: an open trajectory's base URL for an Anthropic client (True) or an
    OpenAI one, None for a trajectory that is not open."""
    where = f"{request.method} {request.path}"
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = sorted(set(exc.allowed_methods) - {"HEAD"})
        message = f"{where}: method not allowed; this path is served for {' and '.join(allowed)}."
        return ProxyError(405, message, code="method_not_allowed"), {"Allow": ", ".join(sorted(exc.allowed_methods))}
    if not isinstance(exc, web.HTTPNotFound):
        return ProxyError(exc.status, f"{exc.reason}: {where}"), {}
    routes = served_routes(request.app)
    parts = [f"No route for {where}."]
    hint = _matching(request.method, request.path, routes)
    if hint is not None:
        endpoint, patterns = hint
        parts.append(f"{request.method} {endpoint} is served at {' and '.join(patterns)}.")
    anthropic = wants_anthropic(request.path, request.headers)
    base = next((url for seg in request.path.split("/") if seg and (url := base_url_of(seg, anthropic))), None)
    if base is not None:
        parts.append(f"This trajectory's base URL is {base}{_APPENDS if anthropic else ''}.")
    elif hint is not None and "/v1/" in hint[1][-1]:
        root = str(request.url.origin()) + hint[1][-1].split("/v1/")[0]
        if anthropic:
            parts.append(f"An Anthropic client's base_url is {root}{_APPENDS}.")
        else:
            parts.append(f"An OpenAI client's base_url is {root}/v1.")
    parts.append("Routes: " + ", ".join(f"{m} {p}" for m, p in routes) + ".")
    return ProxyError(404, " ".join(parts), code="unknown_route"), {}


def _matching(method: str, path: str, routes: list[tuple[str, str]]) -> tuple[str, list[str]] | None:
    """The endpoint ``path`` seems to mean (its tail, with or without ``/v1``) and the patterns serving it."""
    found: dict[str, list[str]] = {}
    for m, pattern in routes:
        if m != method:
            continue
        endpoint = pattern.split("{attempt}")[-1]
        rx = re.escape(endpoint.removeprefix("/v1"))
        rx = re.sub(r"\\\{[^}]*\\\}", "[^/]+", rx)  # a parameter of the endpoint itself (a tool's name)
        if re.search(f"(?:/v1)?{rx}$", path):
            found.setdefault(endpoint, []).append(pattern)
    if not found:
        return None
    endpoint = max(found, key=len)  # the most specific endpoint that fits
    return endpoint, sorted(found[endpoint], key=len)
