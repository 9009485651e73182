"""Typed config: YAML + dotted overrides, one-line errors with suggestions, saved with the run."""

import pytest
import yaml

from agentflow.config import ConfigError, load_config, save_config


def test_yaml_plus_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("run:\n  steps: 3\nstore:\n  batch_groups: 2\n")
    cfg = load_config(p, ["run.steps=5", "rollout.temperature=0.7", "env.kwargs.max_turns=2"])
    assert cfg.run.steps == 5 and cfg.store.batch_groups == 2 and cfg.rollout.temperature == 0.7
    assert cfg.env.kwargs == {"max_turns": 2}
    out = save_config(cfg, tmp_path / "run")
    assert yaml.safe_load(out.read_text())["run"]["steps"] == 5


@pytest.mark.parametrize(
    "override, message",
    [
        ("store.batch_grups=3", "unknown config key 'store.batch_grups'. Did you mean 'store.batch_groups'?"),
        ("store.batch_groups=abc", "config key 'store.batch_groups': Input should be a valid integer"),
        ("run.mode=fast", "config key 'run.mode': Input should be 'async', 'one_step' or 'sync'"),
        ("rollout.top_p=0", "config key 'rollout.top_p'"),
        ("steps", "override 'steps' is not key=value"),
        ("trainer.ep=2", "ep=2 must divide tp=1"),
    ],
)
def test_bad_keys_and_types_give_one_line_errors(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_kv_on_update_is_one_setting_the_transport_follows():
    keep = load_config(None, ["engine.kv_on_update=keep", "store.stale_steps=3"])
    assert keep.transfer["flush_cache"] is False and keep.engine.kv_max_age == 3
    flush = load_config(None, ["run.mode=one_step"])
    assert flush.transfer["flush_cache"] is True and flush.engine.kv_max_age == 1
    assert load_config(None, ["engine.kv_on_update=recompute", "engine.kv_max_age=0"]).engine.kv_max_age == 0
    with pytest.raises(ConfigError, match="say engine.kv_on_update: keep"):
        load_config(None, ['transfer={"type": "inprocess", "flush_cache": false}'])
    with pytest.raises(ConfigError, match="engine.kv_on_update: recompute re-prefills"):
        load_config(None, ["engine.kv_on_update=recompute", "engine.type=sglang"])
    with pytest.raises(ConfigError, match="engine.kv_spill_bytes: the embedded engine's cache setting"):
        load_config(None, ["engine.kv_spill_bytes=1000", "engine.type=sglang"])


@pytest.mark.parametrize(
    "extra, why",
    [
        (["engine.type=sglang"], "an SGLang server serves one weight version"),
        (['engine.elastic=[{"at_step": 2, "engines": 2}]'], "an engine that joins holds only the newest"),
        (["ray.enabled=true"], "engine actors do not take the versions"),
        (["agent.type=blackbox"], "only the whitebox loop pins"),
        (["engine.kv_on_update=keep"], "keeps its own version's KV"),
    ],
)
def test_pin_is_refused_where_versions_cannot_be_held(extra, why):
    with pytest.raises(ConfigError, match=why):
        load_config(None, ["rollout.partial=pin", *extra])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)


def test_every_field_is_documented():
    from pydantic import BaseModel

    from agentflow.config import JobConfig

    for key, section in JobConfig.model_fields.items():
        if not (isinstance(section.annotation, type) and issubclass(section.annotation, BaseModel)):
            assert section.description, f"JobConfig.{key} has no docstring"
            continue
        for name, field in section.annotation.model_fields.items():
            assert field.description, f"{section.annotation.__name__}.{name} has no docstring"
