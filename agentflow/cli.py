"""``agentflow`` command line. Heavy imports happen inside the commands, so ``--help`` is instant."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentflow.config import JobConfig


def _positive_mib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of MiB, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="agentflow", description="Agentic environment gym + asynchronous RL trainer")
    sub = p.add_subparsers(dest="cmd", required=True)

    model = sub.add_parser("model", help="model utilities").add_subparsers(dest="model_cmd", required=True)
    init = model.add_parser(
        "init", help="create a small random Qwen2/Qwen3/Qwen3-MoE model directory with a local tokenizer"
    )
    init.add_argument("out_dir")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--hidden-size", type=int, default=256)
    init.add_argument("--layers", type=int, default=4)
    init.add_argument("--arch", choices=["qwen2", "qwen3", "qwen3_moe"], default="qwen2")
    init.add_argument("--env", action="append", default=[], help="env id whose text joins the tokenizer corpus")

    train = sub.add_parser("train", help="run an RL job (warm-up SFT, then RL) from a YAML config")
    train.add_argument("config", nargs="?", help="YAML config (defaults if omitted)")
    train.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. run.steps=10")

    distill = sub.add_parser("distill", help="on-policy distillation from teachers routed by data source")
    distill.add_argument("config", nargs="?", help="YAML config with a `teachers` section")
    distill.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    train.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its newest checkpoint and journal")

    plan = sub.add_parser("plan", help="simulate a run's job at other modes and cluster sizes (calibrated on it)")
    plan.add_argument("run_dir", help="a real RL run's directory (config, journal, metrics, summary)")
    plan.add_argument("--gpus", default="8,64,1024", help="cluster sizes to plan for (comma-separated)")
    plan.add_argument(
        "--modes",
        default="sync,async",
        help="run.mode values to compare (comma-separated; async+replay: async with adaptive replay)",
    )
    plan.add_argument("--steps", type=int, default=6, help="RL steps simulated per cluster scenario")
    plan.add_argument("--speed", type=float, default=None, help="engine tokens/s at one request (default: fitted)")
    plan.add_argument(
        "--curve", default=None, help="engine benchmark JSON: the batched-decode curve and the prefill/decode ratio"
    )
    plan.add_argument(
        "--cores",
        default=None,
        help="cores the run's engines, trainer and tools shared (models their contention): a number, or 'auto' to "
        "measure this machine's effective cores",
    )
    plan.add_argument("--env-cpu-s", type=float, default=0.0, help="CPU seconds of one env step (with --cores)")
    plan.add_argument("--out", default=None, help="also write the plan as JSON here")

    ev = sub.add_parser("eval", help="greedy success on held-out tasks")
    ev.add_argument("config", nargs="?")
    ev.add_argument("overrides", nargs="*")
    ev.add_argument("--model", help="model directory (default: the config's model.path)")

    serve = sub.add_parser("serve", help="serve a model directory over the SGLang HTTP protocol (embedded engine)")
    serve.add_argument("model_dir")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=30000)
    serve.add_argument("--max-slots", type=int, default=32)
    serve.add_argument("--max-len", type=int, default=2048)
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--max-request-mb", type=_positive_mib, default=64.0, metavar="MIB",
                       help="largest request body in MiB (default 64); a larger one is refused with HTTP 413 and a "
                       "JSON error that names the limit")  # fmt: skip

    _proxy_parser(sub)

    envs_p = sub.add_parser("envs", help="environment registry").add_subparsers(dest="envs_cmd", required=True)
    envs_p.add_parser("list", help="list registered environment ids")
    check = envs_p.add_parser("check", help="run gymnasium check_env + async conformance on an environment")
    check.add_argument("env_id")
    check.add_argument("--seed", type=int, default=7)
    check.add_argument("--fuzz", type=int, default=0, metavar="N", help="then send N malformed actions")
    check.add_argument("--fuzz-seed", type=int, default=None, help="seed of the malformed actions (default: fresh)")
    play = envs_p.add_parser("play", help="play an episode: type canonical JSON actions (or a bare answer) per line")
    play.add_argument("env_id")
    play.add_argument("--seed", type=int, default=0)
    play.add_argument("--split", default="train")
    play.add_argument("--task-set", default=None)
    return p


def _proxy_parser(sub: argparse._SubParsersAction) -> None:
    proxy = sub.add_parser("proxy", help="the black-box recording proxy").add_subparsers(
        dest="proxy_cmd", required=True
    )
    serve = proxy.add_parser(
        "serve", help="serve a model to OpenAI-API agents on 127.0.0.1 and record every call, without a training job"
    )
    serve.add_argument("model_dir", help="model directory (weights for the embedded engine; tokenizer and template)")
    serve.add_argument("--port", type=int, default=8000, help="port on 127.0.0.1 (0: any free one)")
    serve.add_argument("--sglang", nargs="+", action="extend", default=[], metavar="URL",
                       help="generate on these SGLang servers instead of the embedded engine")  # fmt: skip
    serve.add_argument("--record", default="runs/proxy", metavar="DIR", help="where each trajectory's JSON goes")
    serve.add_argument("--api-key", default=None, help="the key clients must send (default: $AGENTFLOW_PROXY_KEY, "
                       "else a generated one, printed)")  # fmt: skip
    serve.add_argument("--model-name", default="agentflow-policy", help="the model name clients ask for")
    serve.add_argument("--max-len", type=int, default=2048, help="context tokens per trajectory segment")
    serve.add_argument("--max-slots", type=int, default=8, help="sequences the embedded engine decodes together")
    serve.add_argument("--max-new-tokens", type=int, default=512, help="most new tokens of one call")
    serve.add_argument("--temperature", type=float, default=1.0, help="for requests that name none")
    serve.add_argument("--seed", type=int, default=0, help="the embedded engine's seed")
    serve.add_argument("--train-side-calls", action="store_true", help="mark side and retry segments trained")


def _run_proxy(args: argparse.Namespace) -> int:
    from agentflow.proxy.serve import ServeOptions, serve_proxy

    serve_proxy(ServeOptions(
        model_dir=args.model_dir, port=args.port, sglang=list(args.sglang), record=args.record, api_key=args.api_key,
        model_name=args.model_name, max_len=args.max_len, max_slots=args.max_slots,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
        train_side_calls=args.train_side_calls,
    ))  # fmt: skip
    return 0


def _run_envs(args: argparse.Namespace) -> int:
    import envs

    if args.envs_cmd == "check":
        from envs.console import check

        check(args.env_id, seed=args.seed, fuzz=args.fuzz, fuzz_seed=args.fuzz_seed)
        return 0
    if args.envs_cmd == "play":
        from envs.console import play

        play(args.env_id, seed=args.seed, split=args.split, task_set=args.task_set)
        return 0
    for env_id in envs.list_envs():
        print(env_id)
    return 0


def _split_config(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """Allow `agentflow train key=value` without a config file."""
    from pathlib import Path

    from agentflow.config import ConfigError

    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not config.endswith((".yaml", ".yml")):
        overrides.insert(0, config)
        config = None
    looks_dotted = "." in config and "/" not in config and not config.endswith((".yaml", ".yml")) if config else False
    if config is not None and looks_dotted and not Path(config).exists():
        raise ConfigError(f"'{config}' is neither a config file nor key=value (did you mean '{config}=VALUE'?)")
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not key=value (did you mean '{item}=VALUE'?)")
    return config, overrides


def _resume_config(run_dir: str, config: str | None, overrides: list[str]) -> tuple[str, list[str]]:
    """A resumed run reads the config saved in its directory; overrides (say, more ``run.steps``) still apply."""
    from pathlib import Path

    from agentflow.config import ConfigError

    if config is not None:
        raise ConfigError(f"--resume takes its config from {run_dir}/config.yaml; give overrides only, not {config}")
    saved = Path(run_dir) / "config.yaml"
    if not saved.is_file():
        raise ConfigError(f"cannot resume {run_dir}: no config.yaml there (not a run directory)")
    return str(saved), [f"run.dir={run_dir}", *overrides]


def _run(args: argparse.Namespace) -> int:
    if args.cmd == "model":
        from agentflow.model_init import ModelInitConfig, count_parameters, init_model

        init = ModelInitConfig(
            seed=args.seed, hidden_size=args.hidden_size, num_hidden_layers=args.layers, arch=args.arch
        )
        out = init_model(args.out_dir, init, env_ids=args.env)
        print(f"wrote {out} ({count_parameters(init) / 1e6:.2f}M parameters)")
        return 0
    if args.cmd == "serve":
        import os

        from agentflow.engine.server import serve

        key = os.environ.get("AGENTFLOW_ENGINE_KEY")  # the run's key stays off the command line
        if not key:
            import secrets

            key = secrets.token_urlsafe(24)
            print(f"agentflow: AGENTFLOW_ENGINE_KEY not set; this server's key is {key}", file=sys.stderr)
        limit = max(1, int(args.max_request_mb * (1 << 20)))
        serve(args.model_dir, args.host, args.port, key, args.max_slots, args.max_len, args.seed, limit)
        return 0
    if args.cmd == "envs":
        return _run_envs(args)
    if args.cmd == "proxy":
        return _run_proxy(args)
    if args.cmd == "plan":
        from agentflow.planner import run_plan

        return run_plan(args)
    from agentflow.config import load_config

    config, overrides = _split_config(args)
    resume = getattr(args, "resume", None)
    if resume:
        config, overrides = _resume_config(resume, config, overrides)
    cfg = load_config(config, overrides)
    if args.cmd == "eval":
        from agentflow.recipes.evaluate import run_eval

        result = run_eval(cfg, args.model)
        print(json.dumps(result, indent=2))
        return _failed("evaluation", result)
    return _train(args.cmd, cfg, bool(resume))


def _train(cmd: str, cfg: JobConfig, resume: bool) -> int:
    """``train`` (RL, or distillation when the config has teachers) and ``distill``."""
    from trainer.launcher import TrainerError

    if cmd == "distill" or cfg.teachers.models:
        from agentflow.recipes.distill import run_distill as run
    else:
        from agentflow.recipes.rl import run_job as run
    try:
        summary = run(cfg, resume=resume)
    except TrainerError as e:
        print(f"agentflow: {e}\nagentflow: continue with `agentflow train --resume {cfg.run.dir}`", file=sys.stderr)
        return 1
    print(json.dumps({k: v for k, v in summary.items() if not isinstance(v, dict | list)}, indent=2))
    return _failed("job", summary)


def _failed(what: str, summary: dict) -> int:
    """1, after one line naming the reason, when every episode ended ``error``; else 0."""
    from agentflow.recipes.common import all_failed

    reason = all_failed(summary)
    if reason is None:
        return 0
    print(f"agentflow: error: {what}: {reason}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if "" not in sys.path and os.getcwd() not in sys.path:  # `module:id` finds the user's files, as `python -m` does
        sys.path.insert(0, os.getcwd())
    from agentflow.builder import JobError
    from agentflow.config import ConfigError
    from agentflow.resume import ResumeError
    from envs.errors import EnvError

    try:
        return _run(args)
    except (ConfigError, JobError, EnvError, ResumeError, FileNotFoundError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        print(f"agentflow: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("agentflow: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
