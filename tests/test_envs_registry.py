"""The env registry: make, defaults, entry points, helpful errors, plugins."""

import importlib.metadata
import sys
import types

import pytest

import envs
from envs import registry
from envs.errors import UnknownEnvError
from envs.registry import InvalidEnvIdError


class _Dummy:
    def __init__(self, size: int = 1, color: str = "red", max_turns: int | None = None):
        self.size, self.color, self.max_turns = size, color, max_turns


@pytest.fixture
def clean_registry(monkeypatch):
    """Run a test against a copy of the registry, with plugins not yet loaded."""
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))
    monkeypatch.setattr(registry, "_plugins_loaded", False)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: [])


def test_builtin_registered_and_make_string_entry_point():
    assert "agentflow/Calc-v0" in envs.list_envs()
    env = envs.make("agentflow/Calc-v0", split="eval")
    try:
        assert env.max_turns == 3 and env.split == "eval"
        assert env.spec is not None and env.spec.id == "agentflow/Calc-v0"
    finally:
        env.close()


def test_default_kwargs_merge_and_callable_entry_point(clean_registry):
    envs.register("test/Dummy-v1", _Dummy, kwargs={"size": 5, "color": "blue"}, max_turns=4)
    env = envs.make("test/Dummy-v1", color="green")
    assert (env.size, env.color, env.max_turns) == (5, "green", 4)
    assert envs.make("test/Dummy-v1", max_turns=9).max_turns == 9
    assert envs.spec("test/Dummy-v1").version == 1
    envs.register("Plain-v0", f"{__name__}:_Dummy")
    assert isinstance(envs.make("Plain-v0"), _Dummy)


def test_did_you_mean(clean_registry):
    with pytest.raises(UnknownEnvError) as err:
        envs.make("agentflow/Clac-v0")
    msg = str(err.value)
    assert "Did you mean 'agentflow/Calc-v0'?" in msg and "\n" not in msg
    with pytest.raises(KeyError, match="Did you mean 'agentflow/Calc-v0'"):
        envs.make("Calc-v0")


def test_version_hint(clean_registry):
    envs.register("test/Dummy-v1", _Dummy)
    envs.register("test/Dummy-v3", _Dummy)
    with pytest.raises(UnknownEnvError, match=r"'test/Dummy' exists in version\(s\): v1, v3"):
        envs.spec("test/Dummy-v2")


@pytest.mark.parametrize("bad", ["Dummy", "Dummy-v", "ns/Dummy-vx", "a/b/Dummy-v0", "Dum my-v0", ""])
def test_bad_id_format(clean_registry, bad):
    with pytest.raises(InvalidEnvIdError, match="expected 'Name-vN' or 'namespace/Name-vN'"):
        envs.register(bad, _Dummy)
    with pytest.raises(UnknownEnvError, match="malformed"):
        envs.make(bad)


def test_plugin_entry_point_loaded_once(clean_registry, monkeypatch):
    module = types.ModuleType("fake_af_plugin")
    calls = []

    def register_all():
        calls.append(1)
        envs.register("plug/Thing-v0", _Dummy, kwargs={"size": 7})

    module.register_all = register_all
    monkeypatch.setitem(sys.modules, "fake_af_plugin", module)
    eps = [importlib.metadata.EntryPoint("thing", "fake_af_plugin:register_all", registry.PLUGIN_GROUP)]
    seen_groups = []

    def fake_entry_points(**kw):
        seen_groups.append(kw.get("group"))
        return eps

    monkeypatch.setattr(importlib.metadata, "entry_points", fake_entry_points)
    assert envs.make("plug/Thing-v0").size == 7
    with pytest.raises(UnknownEnvError):
        envs.make("plug/Other-v0")
    assert calls == [1] and seen_groups == [registry.PLUGIN_GROUP]


def test_broken_plugin_warns(clean_registry, monkeypatch):
    eps = [importlib.metadata.EntryPoint("broken", "no_such_module_xyz:thing", registry.PLUGIN_GROUP)]
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: eps)
    with pytest.warns(UserWarning, match="could not load environment plugin 'broken'"):
        assert "agentflow/Calc-v0" in envs.list_envs()
