"""The environment registry: versioned ids, ``make``, "did you mean" errors, and entry-point plugins.

Ids follow Gymnasium's manners: ``Name-vN`` or ``namespace/Name-vN``; ``module:ns/Name-vN`` imports ``module``
first (it registers the id). Third-party packages add environments by
declaring an entry point in group ``agentflow.envs`` (a module to import, or a no-argument function to call, that
calls :func:`register`); they are loaded once, the first time an id is not found (or on :func:`list_envs`).

The two registries are one: :func:`register` also registers the id in Gymnasium's registry (same entry point and
kwargs), so ``gymnasium.make("agentflow/Calc-v0")`` builds it once ``envs`` is imported; and an id registered only
with ``gymnasium.register`` is found here too, adapted by :class:`envs.gym_adapter.GymTextEnv` when its spaces carry
text (it is refused with the reason when they do not).

An env may declare its scripted expert (``register(..., expert="module:function")`` or a callable taking
``(env, history)`` and returning an action): jobs use it for warm-up SFT and the scripted baseline.
"""

from __future__ import annotations

import difflib
import functools
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
    expert: str | Callable[..., Any] | None = None
    """The env's scripted expert, ``module:function`` or a callable ``(env, history) -> action``; None: none."""
    source: str = "agentflow"
    """``agentflow`` (registered here) or ``gymnasium`` (only in Gymnasium's registry, built through the adapter)."""

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
        """Build the environment with the registered kwargs overridden by ``kwargs``.

        ``action_limits`` (an :class:`~envs.limits.ActionLimits` or a dict of its fields) is not passed to the
        constructor: it replaces the built env's limits (:mod:`envs.limits`).
        """
        creator = _load_entry_point(self.entry_point)
        merged = {**self.kwargs, **kwargs}
        limits = merged.pop("action_limits", None)
        if self.max_turns is not None:
            merged.setdefault("max_turns", self.max_turns)
        env = creator(**merged)
        if limits is not None:
            _set_limits(env, limits)
        if self.source == "agentflow":
            _attach_gym_spec(env, self, merged)
        return env

    def load_expert(self) -> Callable[..., Any] | None:
        """The declared expert as a callable (None when the env declares none)."""
        if self.expert is None:
            return None
        try:
            return _load_entry_point(self.expert)
        except EnvError as e:
            raise EnvError(f"the expert {self.expert!r} declared by {self.id!r} cannot be loaded: {e}") from e


_registry: dict[str, EnvSpec] = {}
_mirrored: dict[str, Any] = {}
"""Gymnasium specs this registry wrote into Gymnasium's (they are ours, not Gymnasium-only envs)."""
_lock = threading.RLock()
_plugins_loaded = False


def _check_callable_path(what: str, value: str | Callable[..., Any]) -> None:
    if isinstance(value, str):
        if ":" not in value:
            raise InvalidEnvIdError(f"{what} {value!r} must look like 'package.module:Attribute'")
    elif not callable(value):
        raise TypeError(f"{what} must be a 'module:Attribute' string or a callable, got {value!r}")


def register(
    id: str,  # noqa: A002 - Gymnasium's name for it
    entry_point: str | Callable[..., Any],
    kwargs: dict[str, Any] | None = None,
    max_turns: int | None = None,
    expert: str | Callable[..., Any] | None = None,
) -> EnvSpec:
    """Register an environment; ``entry_point`` is ``"module:Class"`` or a callable returning the env.

    ``max_turns`` (when given) is passed to the constructor as ``max_turns=`` unless the caller passes one.
    ``expert``: the env's scripted expert (``"module:function"`` or a callable ``(env, history) -> action``).
    The id is registered in Gymnasium's registry too. Re-registering an id replaces it (with a warning when the
    spec differs).
    """
    parse_id(id)
    _check_callable_path("entry_point", entry_point)
    if expert is not None:
        _check_callable_path("expert", expert)
    new = EnvSpec(id, entry_point, dict(kwargs or {}), max_turns, expert)
    with _lock:
        old = _registry.get(id)
        if old is not None and old != new:
            warnings.warn(f"overriding environment {id!r} already registered", stacklevel=2)
        _registry[id] = new
        _mirror(new)
    return new


def _mirror(env_spec: EnvSpec) -> None:
    """Write ``env_spec`` into Gymnasium's registry (without Gymnasium's override warning: ours already warned)."""
    from gymnasium.envs.registration import EnvSpec as GymSpec
    from gymnasium.envs.registration import registry as gym_registry

    kwargs = dict(env_spec.kwargs)
    if env_spec.max_turns is not None:
        kwargs.setdefault("max_turns", env_spec.max_turns)
    gym_spec = GymSpec(id=env_spec.id, entry_point=env_spec.entry_point, kwargs=kwargs)
    gym_registry[env_spec.id] = gym_spec
    _mirrored[env_spec.id] = gym_spec


def _gymnasium_spec(env_id: str) -> EnvSpec | None:
    """An id registered only in Gymnasium's registry, as a spec built through the text adapter."""
    from gymnasium.envs.registration import registry as gym_registry

    gym_spec = gym_registry.get(env_id)
    if gym_spec is None or _mirrored.get(env_id) is gym_spec:
        return None
    from envs.gym_adapter import make_from_gymnasium

    return EnvSpec(env_id, functools.partial(make_from_gymnasium, env_id), source="gymnasium")


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
        found = _gymnasium_spec(id)
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


def _set_limits(env: Any, limits: Any) -> None:
    from envs.core import AgentEnv
    from envs.limits import ActionLimits

    if not isinstance(env, AgentEnv):
        raise EnvError(f"action_limits applies to AgentEnv environments, not {type(env).__name__}")
    try:
        env.action_limits = ActionLimits.coerce(limits, env.action_limits)
    except (TypeError, ValueError) as e:
        raise EnvError(str(e)) from None


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
