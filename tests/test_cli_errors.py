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
