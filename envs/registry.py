"""The environment registry: versioned ids, ``make``, "did you mean" errors, and entry-point plugins.

Ids follow Gymnasium's manners: ``Name-vN`` or ``namespace/Name-vN``; ``module:ns/Name-vN`` imports ``module``
first (it registers the id). Third-party packages add environments by
declaring an entry point in group ``agentflow.envs`` (a module to import, or a no-argument function to call, that
calls :func:`register`); they are loaded once, the first time an id is not found (or on :func:`list_envs`).
"""

from __future__ import annotations

import difflib
import importlib
import re
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from envs.errors import EnvError, UnknownEnvError

PLUGIN_GROUP = "agentflow.envs"
_ID_RE = re.compile(r"^(?:(?P<ns>[A-Za-z0-9_][\w.-]*)/)?(?P<name>[A-Za-z_][\w.-]*?)-v(?P<version>\d+)$")
ID_FORMAT = "'Name-vN' or 'namespace/Name-vN' (e.g. 'agentflow/Calc-v0')"


class InvalidEnvIdError(EnvError, ValueError):
    """An id that is not of the form ``Name-vN`` or ``namespace/Name-vN``."""


def parse_id(env_id: str) -> tuple[str | None, str, int]:
    """Split an id into (namespace, name, version); raises :class:`InvalidEnvIdError` for a malformed one."""
    m = _ID_RE.match(env_id) if isinstance(env_id, str) else None
    if m is None:
        raise InvalidEnvIdError(f"malformed environment id {env_id!r}: expected {ID_FORMAT}")
    return m.group("ns"), m.group("name"), int(m.group("version"))


@dataclass(frozen=True)
class EnvSpec:
    """How to build one registered environment."""

    id: str
    entry_point: str | Callable[..., Any]
    kwargs: dict[str, Any] = field(default_factory=dict)
    max_turns: int | None = None

    @property
    def namespace(self) -> str | None:
        """The part before ``/``, if any."""
        return parse_id(self.id)[0]

    @property
    def name(self) -> str:
        """The name without namespace and version."""
        return parse_id(self.id)[1]

    @property
    def version(self) -> int:
        """The N of ``-vN``."""
        return parse_id(self.id)[2]

    def make(self, **kwargs: Any) -> Any:
        """Build the environment with the registered kwargs overridden by ``kwargs``."""
        creator = _load_entry_point(self.entry_point)
        merged = {**self.kwargs, **kwargs}
        if self.max_turns is not None:
            merged.setdefault("max_turns", self.max_turns)
        env = creator(**merged)
        _attach_gym_spec(env, self, merged)
        return env


_registry: dict[str, EnvSpec] = {}
_lock = threading.RLock()
_plugins_loaded = False


def register(
    id: str,  # noqa: A002 - Gymnasium's name for it
    entry_point: str | Callable[..., Any],
    kwargs: dict[str, Any] | None = None,
    max_turns: int | None = None,
) -> EnvSpec:
    """Register an environment; ``entry_point`` is ``"module:Class"`` or a callable returning the env.

    ``max_turns`` (when given) is passed to the constructor as ``max_turns=`` unless the caller passes one.
    Re-registering an id replaces it (with a warning when the spec differs).
    """
    parse_id(id)
    if isinstance(entry_point, str):
        if ":" not in entry_point:
            raise InvalidEnvIdError(f"entry_point {entry_point!r} must look like 'package.module:Attribute'")
    elif not callable(entry_point):
        raise TypeError(f"entry_point must be a 'module:Attribute' string or a callable, got {entry_point!r}")
    new = EnvSpec(id, entry_point, dict(kwargs or {}), max_turns)
    with _lock:
        old = _registry.get(id)
        if old is not None and old != new:
            warnings.warn(f"overriding environment {id!r} already registered", stacklevel=2)
        _registry[id] = new
    return new


def spec(id: str) -> EnvSpec:  # noqa: A002
    """The spec of ``id``; raises :class:`UnknownEnvError` (with suggestions) when it is not registered.

    ``"package.module:ns/Name-vN"`` first imports ``package.module`` (which calls :func:`register`), as in
    Gymnasium: a user's env file works with ``make``, job configs and ``agentflow envs check`` without a plugin.
    """
    if isinstance(id, str) and ":" in id:
        module, _, id = id.partition(":")
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise UnknownEnvError(f"cannot import module {module!r} that should register {id!r}: {e}") from e
    with _lock:
        found = _registry.get(id)
    if found is None:
        load_plugins()
        with _lock:
            found = _registry.get(id)
    if found is None:
        raise UnknownEnvError(_unknown_message(id))
    return found


def make(id: str, **kwargs: Any) -> Any:  # noqa: A002
    """Build environment ``id``; ``kwargs`` override the registered default kwargs."""
    return spec(id).make(**kwargs)


def list_envs() -> list[str]:
    """All registered ids (plugins included), sorted."""
    load_plugins()
    with _lock:
        return sorted(_registry)


def load_plugins(force: bool = False) -> list[str]:
    """Load the ``agentflow.envs`` entry points once (again with ``force``); returns the names loaded.

    A plugin that fails to load is skipped with a warning: one broken package must not hide every environment.
    """
    global _plugins_loaded
    with _lock:
        if _plugins_loaded and not force:
            return []
        _plugins_loaded = True
    import importlib.metadata  # lazily: it costs ~60 ms at import

    loaded = []
    for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP):
        try:
            obj = ep.load()
            if callable(obj):
                obj()
            loaded.append(ep.name)
        except Exception as e:  # noqa: BLE001 - report and continue
            warnings.warn(f"could not load environment plugin {ep.name!r} ({ep.value}): {e!r}", stacklevel=2)
    return loaded


def _unknown_message(env_id: str) -> str:
    ids = sorted(_registry)
    try:
        ns, name, _ = parse_id(env_id)
    except InvalidEnvIdError as e:
        hint = _closest(env_id, ids)
        return f"{e}." + (f" Did you mean {hint!r}?" if hint else "")
    base = f"{ns}/{name}" if ns else name
    versions = sorted(s.version for s in _registry.values() if (s.namespace, s.name) == (ns, name))
    if versions:
        listed = ", ".join(f"v{v}" for v in versions)
        return f"environment {env_id!r} is not registered, but {base!r} exists in version(s): {listed}."
    hint = _closest(env_id, ids)
    return f"environment {env_id!r} is not registered." + (f" Did you mean {hint!r}?" if hint else "")


def _closest(env_id: str, ids: list[str]) -> str | None:
    match = difflib.get_close_matches(env_id, ids, n=1, cutoff=0.6)
    if match:
        return match[0]
    # The same name in another namespace (e.g. 'Calc-v0' for 'agentflow/Calc-v0').
    tail = env_id.rsplit("/", 1)[-1]
    tails = {i.rsplit("/", 1)[-1]: i for i in ids}
    match = difflib.get_close_matches(tail, list(tails), n=1, cutoff=0.6)
    return tails[match[0]] if match else None


def _load_entry_point(entry_point: str | Callable[..., Any]) -> Callable[..., Any]:
    if callable(entry_point):
        return entry_point
    module_name, _, attr = entry_point.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise EnvError(f"cannot load entry point {entry_point!r}: {e}") from e
    return obj


def _attach_gym_spec(env: Any, env_spec: EnvSpec, kwargs: dict[str, Any]) -> None:
    """Give Gymnasium envs a ``gymnasium`` EnvSpec, so ``env.spec.make()`` and ``check_env`` work as usual."""
    try:
        import gymnasium
        from gymnasium.envs.registration import EnvSpec as GymSpec
    except ImportError:  # pragma: no cover - gymnasium is a dependency
        return
    if isinstance(env, gymnasium.Env):
        env.spec = GymSpec(
            id=env_spec.id,
            entry_point=env_spec.entry_point,
            kwargs=dict(kwargs),
            disable_env_checker=True,
            order_enforce=False,
        )
