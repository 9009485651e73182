"""``module:attribute`` references in configs (agents, black-box programs, scripted experts): one loader, one error."""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from typing import Any


def load_reference(ref: str, what: str) -> Callable[..., Any]:
    """The callable ``ref`` (``module:attribute``) names; a ValueError that says which part is wrong otherwise,
    with the closest attribute of the module when there is one. ``what`` names the config key in the message."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} must look like 'module:attribute', got {ref!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{what} {ref!r}: cannot import module {module_name!r} ({e})") from None
    obj = getattr(module, attr, None)
    if not callable(obj):
        names = [n for n in dir(module) if not n.startswith("_")]
        close = difflib.get_close_matches(attr, names, n=1)
        hint = f" Did you mean '{module_name}:{close[0]}'?" if close else ""
        raise ValueError(f"{what} {ref!r}: module {module_name!r} has no callable {attr!r}.{hint}")
    return obj
