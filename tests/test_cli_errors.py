"""Bad input gives one clear line (with a suggestion where one exists), not a traceback."""

import pytest

from agentflow.cli import main


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["train", "env.id=agentflow/Calc-v9"], "exists in version(s): v0"),
        (["train", "env.id=agentflow/Calk-v0"], "Did you mean 'agentflow/Calc-v0'?"),
        (["train", "store.batch_grups=2"], "'store.batch_grups'. Did you mean 'store.batch_groups'?"),
        (["train", "run.steps=many"], "config key 'run.steps'"),
        (["train", "configs/missing.yaml"], "config file not found: configs/missing.yaml"),
        (["eval", "--model", "/nonexistent/model"], "model directory not found: /nonexistent/model"),
    ],
)
def test_one_line_errors(argv, expected, capsys, tmp_path):
    argv = [*argv, f"run.dir={tmp_path}/run"] if argv[0] == "train" else argv
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("agentflow: error: ") and "\n" not in err
    assert expected in err


def test_missing_model_dir_without_init(capsys, tmp_path):
    code = main(["train", f"model.path={tmp_path}/absent", "model.init_if_missing=false", f"run.dir={tmp_path}/r"])
    assert code == 2
    err = capsys.readouterr().err
    assert f"model directory not found: {tmp_path}/absent" in err and "agentflow model init" in err


def test_small_mistakes_get_one_line(capsys, tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    cases = [
        (["train", str(empty)], "is empty"),
        (
            ["train", "run.steps"],
            "'run.steps' is neither a config file nor key=value (did you mean 'run.steps=VALUE'?)",
        ),
        (["train", "configs/demo.yaml", "run.steps"], "override 'run.steps' is not key=value"),
    ]
    for argv, expected in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("agentflow: error: ") and "\n" not in err and expected in err, err


def test_a_run_directory_holding_a_run_is_refused_unless_resumed_or_overwritten(capsys, tmp_path):
    from agentflow.config import load_config
    from agentflow.recipes.common import claim_run_dir

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "journal.jsonl").write_text('{"id": "x"}\n')
    (run / "checkpoints" / "step_1.pt").write_bytes(b"x")
    (run / "notes.txt").write_text("mine")
    assert main(["train", f"run.dir={run}", "sft.enabled=false"]) == 2
    err = capsys.readouterr().err
    assert "already holds a run (journal.jsonl, checkpoints)" in err and f"--resume {run}" in err
    claim_run_dir(load_config(None, [f"run.dir={run}"]), resume=True)  # resuming keeps everything
    assert (run / "journal.jsonl").is_file()
    claim_run_dir(load_config(None, [f"run.dir={run}", "run.overwrite=true"]), resume=False)
    assert not (run / "journal.jsonl").exists() and not (run / "checkpoints").exists()
    assert (run / "notes.txt").read_text() == "mine"  # only what a run writes is removed
