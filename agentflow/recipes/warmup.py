"""Warm-up SFT: imitate a scripted expert's traces, stop when validation loss stops improving, cache the result.

The expert is the one the job's env declares (``envs.register(..., expert=...)``) unless ``sft.expert`` names
another; a job with neither is refused before it starts (:func:`require_expert`).

Traces are played against the real environment (real sandbox) and tokenized with the same incremental chat format
the agent uses, so the warm-up model sees exactly the token layout it will generate in RL. The cache key is a hash
of everything that determines the result (base model files, SFT settings, env id and kwargs, the expert's and the
env's modules, trainer seed).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import envs
from agentflow.builder import trainer_settings
from agentflow.chat import IM_END, ChatTokenizer, ToolCall, parse_reply, render_tool_call
from agentflow.config import JobConfig
from agentflow.entrypoints import load_reference
from envs.core import ToolAction, parse_action
from trainer.types import Sample, TrainerGroup

Expert = Callable[[Any, list[tuple[str, str]]], str]
Log = Callable[[str], None]


def load_expert(path: str) -> Expert:
    """A ``module:function`` taking ``(env, history)`` and returning a canonical action string."""
    return load_reference(path, "sft.expert")


def job_expert(cfg: JobConfig) -> tuple[Expert, str] | None:
    """The scripted expert of the job's env and its ``module:function`` name: ``sft.expert`` when set, else the one
    the env declares; None when there is neither."""
    if cfg.sft.expert:
        return load_expert(cfg.sft.expert), cfg.sft.expert
    declared = envs.spec(cfg.env.id).load_expert()
    if declared is None:
        return None
    return declared, f"{declared.__module__}:{declared.__qualname__}"


def require_expert(cfg: JobConfig) -> tuple[Expert, str]:
    """:func:`job_expert`, or a :class:`~agentflow.builder.JobError` (one line naming the key) without one."""
    from agentflow.builder import JobError

    try:
        found = job_expert(cfg)
    except ValueError as e:
        raise JobError(str(e)) from None
    if found is None:
        raise JobError(
            f"sft.enabled=true needs a scripted expert, and {cfg.env.id} declares none: set sft.expert=module:function,"
            " or sft.enabled=false (RL then starts from the model as it is)"
        )
    return found


def action_text(action: str) -> str:
    """What the model should write for a canonical action (the inverse of the agent's parsing)."""
    act = parse_action(action)
    if isinstance(act, ToolAction):
        return render_tool_call(ToolCall(act.tool, dict(act.arguments)))
    return act.text


def expert_sample(env: Any, expert: Expert, tok: ChatTokenizer, seed: int, split: str) -> tuple[Sample, bool]:
    """Play one expert episode and tokenize it as the agent would; returns the sample and whether it succeeded."""
    obs, info = env.reset(seed=seed, options={"split": split})
    ids = tok.prompt_ids(env.system_prompt, obs, [t.to_openai() for t in env.tools])
    mask = [0] * len(ids)
    history: list[tuple[str, str]] = []
    success = False
    for _ in range(env.max_turns):
        action = expert(env, history)
        out = tok.encode(action_text(action) + IM_END)
        assert parse_reply(tok.decode(out)).error is None  # the format must round-trip
        ids += out
        mask += [1] * len(out)
        obs, reward, terminated, truncated, step_info = env.step(action)
        history.append((action, obs))
        if terminated or truncated:
            success = bool(step_info.get("success", reward > 0))
            break
        more = tok.continuation_ids([{"role": "tool", "content": obs}])
        ids += more
        mask += [0] * len(more)
    return Sample(ids, mask, [0.0] * len(ids), reward=float(success), sample_id=f"{split}:{seed}"), success


def expert_samples(
    cfg: JobConfig, tok: ChatTokenizer, seeds: range, split: str, workers: int = 4
) -> tuple[list[Sample], float]:
    """Expert episodes in parallel threads (each with its own env): the time goes to sandboxed tool calls."""
    expert, _ = require_expert(cfg)
    chunks = [list(seeds)[i::workers] for i in range(workers)]

    def play(chunk: list[int]) -> list[tuple[Sample, bool]]:
        env = envs.make(cfg.env.id, **cfg.env.kwargs)
        try:
            return [expert_sample(env, expert, tok, s, split) for s in chunk]
        finally:
            env.close()

    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(play, chunks))
    pairs = sorted((p for r in results for p in r), key=lambda p: p[0].sample_id)
    return [p[0] for p in pairs], sum(p[1] for p in pairs) / max(len(pairs), 1)


def cache_key(cfg: JobConfig, base_dir: Path) -> str:
    h = hashlib.sha256()
    for name in sorted(p.name for p in base_dir.iterdir() if p.is_file()):
        h.update(name.encode())
        h.update(hashlib.sha256((base_dir / name).read_bytes()).digest())
    expert, name = require_expert(cfg)
    entry = envs.spec(cfg.env.id).entry_point
    env_module = entry.split(":")[0] if isinstance(entry, str) else entry.__module__
    for module in (expert.__module__, env_module):  # the expert's and the env's code decide the traces
        h.update(_module_source(module))
    # thread count does not change the result's meaning; an unset optional key (None) keys as if it did not exist
    sft = cfg.sft.model_dump(exclude={"threads", "expert"}, exclude_none=True)
    trainer = cfg.trainer.model_dump(include=IMITATION_TRAINER_KEYS)
    payload = {"sft": sft, "expert": name, "env": cfg.env.model_dump(), "trainer": trainer, "v": 4}
    h.update(json.dumps(payload, sort_keys=True).encode())
    return h.hexdigest()[:16]


def _module_source(module: str) -> bytes:
    """The source of ``module`` (imported if need be), or its name where it has no file (a notebook's
    ``__main__``): such a module's changes cannot be seen, so they do not invalidate the cache."""
    __import__(module)
    path = getattr(sys.modules[module], "__file__", None)
    return Path(path).read_bytes() if path and Path(path).is_file() else module.encode()


IMITATION_TRAINER_KEYS = {"seed", "weight_decay", "grad_clip", "micro_batch_tokens", "tp", "dp"}
"""The ``trainer`` settings an imitation phase takes from the job (its lr, schedule and threads are its own). It also
runs with the job's ``ep``, which is left out of the cache key: spreading experts over ranks changes the result no
more than rounding does."""


def run_sft(cfg: JobConfig, base_dir: Path, cache_root: Path, log: Callable[[str], None] = print) -> Path:
    """Return an HF directory of the warmed-up model, training it unless the cache already has it."""
    out = cache_root / f"sft-{cache_key(cfg, base_dir)}"
    if (out / "sft_report.json").is_file():
        log(f"SFT warm-up: cached at {out}")
        return out
    tok = ChatTokenizer(base_dir)
    train, expert_success = expert_samples(cfg, tok, range(cfg.sft.episodes), "train")
    val, _ = expert_samples(cfg, tok, range(10_000_000, 10_000_000 + cfg.sft.val_episodes), "train")
    s = cfg.sft
    if s.observation_weight > 0:
        train = [weigh_observations(x, s.observation_weight) for x in train]
    how = Imitation(
        s.lr, s.max_epochs, s.batch_size, s.patience, s.threads, s.warmup_steps_max, stop_val_loss=s.stop_val_loss
    )
    report = imitate(cfg, base_dir, train, val, how, out, log)
    report["expert_success_train"] = expert_success
    (out / "sft_report.json").write_text(json.dumps(report, indent=2))
    return out


def weigh_observations(sample: Sample, weight: float) -> Sample:
    """``sample`` with its non-model tokens in the loss at ``weight`` (the model's own tokens stay at 1)."""
    mask: list[float] = [1.0 if m else weight for m in sample.loss_mask]
    return replace(sample, loss_mask=mask)  # type: ignore[arg-type]  # only the NLL loss reads a fractional mask


@dataclass(frozen=True)
class Imitation:
    """How an imitation phase (warm-up SFT, seq-KD) trains: NLL, early stopping on a held-out set."""

    lr: float
    max_epochs: int
    batch_size: int
    patience: int
    threads: int
    warmup_steps_max: int
    """The LR warms up linearly over a tenth of the steps, at most this many, then decays (cosine)."""
    what: str = "SFT"
    """Name in the log lines."""
    stop_val_loss: float | None = None
    """Stop once validation loss is at or below this (the LR schedule still spans ``max_epochs``)."""


def imitate(
    cfg: JobConfig, base_dir: Path, train: list[Sample], val: list[Sample], how: Imitation, out: Path, log: Log
) -> dict[str, Any]:
    """Train ``base_dir`` on ``train`` with the NLL loss in a trainer group of its own, with the job's trainer
    settings (weight decay, grad clip, micro-batch tokens, parallelism); the best ``val`` weights go to ``out``."""
    from trainer.launcher import make_trainer_group

    steps = how.max_epochs * -(-len(train) // how.batch_size)
    warm = min(how.warmup_steps_max, steps // 10)
    settings = trainer_settings(
        cfg, lr=how.lr, threads=how.threads, warmup_steps=warm, decay_steps=steps - warm, temperature=1.0
    )
    group = make_trainer_group(base_dir, settings, tp=cfg.trainer.tp, dp=cfg.trainer.dp, ep=cfg.trainer.ep)
    try:
        return train_epochs(group, train, val, how, cfg.trainer.seed, out, log)
    finally:
        group.close()


def train_epochs(
    group: TrainerGroup, train: list[Sample], val: list[Sample], how: Imitation, seed: int, out: Path, log: Log
) -> dict[str, Any]:
    """Epochs of the NLL loss on ``train``; the weights with the best ``val`` loss are saved to ``out``."""
    import random

    rng = random.Random(seed)
    best, bad, curve = float("inf"), 0, []
    t0 = time.perf_counter()
    curve.append({"epoch": 0, "val_loss": group.eval_nll(val), "train_loss": None})
    for epoch in range(1, how.max_epochs + 1):
        order = list(range(len(train)))
        rng.shuffle(order)
        losses = []
        for i in range(0, len(order), how.batch_size):
            batch = [train[j] for j in order[i : i + how.batch_size]]
            losses.append(group.train_step(batch, "sft")["loss"])
        val_loss = group.eval_nll(val)
        curve.append({"epoch": epoch, "train_loss": sum(losses) / len(losses), "val_loss": val_loss})
        log(f"{how.what} epoch {epoch}: train {curve[-1]['train_loss']:.4f} val {val_loss:.4f}")
        if val_loss < best - 1e-4:
            best, bad = val_loss, 0
            group.save_hf(str(out))
            if how.stop_val_loss is not None and val_loss <= how.stop_val_loss:
                log(f"{how.what}: validation loss {val_loss:.4f} <= stop_val_loss {how.stop_val_loss}: stopping")
                break
        else:
            bad += 1
            if bad >= how.patience:
                break
    return {"curve": curve, "best_val_loss": best, "epochs": len(curve) - 1, "wall_s": time.perf_counter() - t0}
