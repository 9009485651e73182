"""``agentflow plan``: the job's own store, dispatch and controller loop on a virtual clock, with simulated parts.

What is real: :class:`~agentflow.store.TrajectoryStore` (the staleness window, the ``store.collect`` strategies, the
sync-mode gate), :meth:`agentflow.rollout.Rollouts.feed` (dispatch into the window) and
:func:`agentflow.controller.rl_loop` (take a batch, score, train, sync weights, open the gate), all on a
:class:`~agentflow.virtual_clock.VirtualLoop`. What is simulated, from a real run's directory:

- **Episodes** are drawn from the run's journal (each keeps its turns, model tokens, environment seconds and
  reward together, so the long tail and its correlation with length survive). Each turn generates its share of the
  episode's model tokens on the episode's engine, then waits its share of the environment time.
- **Engines** are processor-sharing servers (``engine.max_slots`` requests at once, the rest queue): each of ``n``
  active requests first prefills its uncached prompt tokens with ``1/n`` of the engine at ``prefill_ratio * speed``
  tokens/s, then decodes; ``k`` decoding requests progress at ``speed * curve(k) / n`` tokens/s each, where
  ``curve`` is the batched-decode throughput curve measured by ``benchmarks/engine.py`` (normalised to 1 at one
  request), ``prefill_ratio`` that benchmark's prefill rate over its one-request decode rate, and ``speed`` the
  single-request decode rate, fitted so the simulated source run reproduces its measured trained samples/s
  (:func:`calibrate`). A trajectory sticks to one engine; ``rollout.max_concurrency`` episodes per engine run at once.
- **The prefix cache**: each turn's context, new tokens and generated tokens come from the journal's turn spans; a
  resumed turn prefills only its new tokens unless a weight update dropped its cached context (``engine.kv_on_update``
  ``flush``, or ``keep`` past ``kv_max_age``), then its whole context but the prompt every episode shares.
- **The trainer** takes ``a + b * samples / trainer_gpus ** dp_exponent`` seconds per step (``a`` and ``b`` fitted
  to the run's ``train/train_s`` against ``train/samples``), then the weight sync its median ``sync/total_s``; new
  weights reach every engine when the sync ends.

- **Shared cores** (``cores``, one machine): engines, the trainer and tool calls' CPU (``env_cpu_s`` per env step)
  draw on a :class:`~agentflow.simulated.Cpu` that slows every part when more threads run than there are cores.

Not modelled: evictions of cached contexts when slots run short, memory bandwidth shared beyond the core count,
engine failures, network limits of weight broadcast. ``async+replay`` runs the store's adaptive replay
(:data:`REPLAY`); its samples/s counts fresh samples, and ``updates_per_s`` the optimizer steps.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from agentflow.config import JobConfig, load_config
from agentflow.rollout import BusyTracker
from agentflow.simulated import (
    Cpu,
    KvPolicy,
    SimEngine,
    SimMixture,
    SimRollouts,
    SimTrainer,
    SimTransport,
    measure_effective_cores,
)
from agentflow.store import TrajectoryStore
from agentflow.virtual_clock import VirtualLoop, run_virtual


class PlanError(ValueError):
    """A run directory cannot be planned from; the message says what is missing."""


@dataclass
class Episode:
    turns: int
    model_tokens: int
    env_s: float
    reward: float
    turn_tokens: list[tuple[int, int, int]] | None = None
    """Per turn: (context tokens before it, of which new since the previous turn's end, tokens it generated); None
    when the journal has no turn spans (then each turn generates an equal share and prefill is not modelled)."""


@dataclass
class RunProfile:
    """What the planner takes from one real run."""

    run_dir: Path
    cfg: JobConfig
    episodes: list[Episode]
    train_a: float
    """Seconds per trainer step not proportional to samples."""
    train_b: float
    """Seconds per trained sample (one trainer process)."""
    keep_frac: float
    """Trained samples / trajectories in a batch (groups left out for a uniform reward)."""
    sync_s: float
    measured_samples_per_s: float | None
    engines: int
    curve: dict[int, float]
    cores: float | None = None
    """Cores of the machine the run used (contention between its parts); None: no contention modelled."""
    env_cpu_s: float = 0.0
    """CPU seconds per env step, measured apart from the run (0 for an env that only waits)."""
    prefill_ratio: float | None = None
    """An engine's prefill tokens/s over its single-request decode tokens/s (``benchmarks/engine.py``'s resume
    without cache); None: prefill is not modelled (the fitted decode rate absorbs it)."""
    shared_prefix: int = 0
    """Prompt tokens every episode of the run starts with (cached once, never prefilled again)."""

    @property
    def mode(self) -> str:
        return self.cfg.run.mode


@dataclass
class Scenario:
    """One simulated job: its mode and window, its batch, and how many engines and trainer GPUs it has."""

    mode: str
    stale_steps: int
    batch_groups: int
    group_size: int
    engines: int
    trainer_gpus: int
    steps: int
    concurrency: int
    """Episodes in flight per engine (``rollout.max_concurrency`` of a one-engine run)."""
    slots: int
    speed: float
    """Single-request decode rate of one engine, tokens/s."""
    dp_exponent: float = 0.9
    """Trainer step time's sample-proportional part shrinks as ``trainer_gpus ** dp_exponent``."""
    seed: int = 0
    cores: float | None = None
    """CPU cores the engines, trainer and tool calls share (one machine); None: each part its own device."""
    env_cpu_s: float = 0.0
    """CPU seconds of one env step (the rest of its time is the tool's own latency); competes only under ``cores``."""
    trainer_threads: float = 1.0


@dataclass
class SimResult:
    samples_per_s: float
    wall_s: float
    trajectories_trained: int
    mean_staleness: float
    max_staleness_seen: int
    engine_idle_fraction: float
    trainer_idle_fraction: float
    trainer_stretch: float
    """Trainer wall time / its work at full speed (above 1 when it shared the cores)."""
    steady_samples_per_s: float
    """Trained samples/s after the first step (leaves out filling the window, which a short simulation overweights)."""
    updates_per_s: float = 0.0
    """Optimizer steps per second (with replay a step trains fewer fresh samples)."""
    replayed_share: float = 0.0
    """Share of the trained groups that were replays (``async+replay``)."""
    prefix_reuse: float | None = None
    """Prompt tokens found cached / prompt tokens (None: the journal has no turn spans)."""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


# ------------------------------------------------------------------------------------------------ the run's profile


def load_profile(
    run_dir: str | Path,
    curve: dict[int, float] | None = None,
    cores: float | None = None,
    env_cpu_s: float = 0.0,
    prefill_ratio: float | None = None,
) -> RunProfile:
    """Episodes, trainer and sync costs, and the measured throughput of the RL run in ``run_dir``."""
    run_dir = Path(run_dir)
    for name in ("config.yaml", "journal.jsonl", "metrics.jsonl"):
        if not (run_dir / name).is_file():
            raise PlanError(f"{run_dir} has no {name}: plan from a finished (or running) RL run's directory")
    cfg = load_config(run_dir / "config.yaml")
    episodes, shared = _episodes(run_dir / "journal.jsonl")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "train/train_s" in r]
    if len(rows) < 2:
        raise PlanError(f"{run_dir}/metrics.jsonl has {len(rows)} RL steps with train/train_s; need at least 2")
    a, b = _fit_line([r.get("train/samples", 0.0) for r in rows], [r["train/train_s"] for r in rows])
    per_batch = cfg.store.batch_groups * cfg.rollout.group_size
    keep = statistics.mean(r.get("train/samples", per_batch) for r in rows) / per_batch
    sync = statistics.median(r.get("sync/total_s", 0.0) for r in rows)
    measured = None
    if (run_dir / "summary.json").is_file():
        s = json.loads((run_dir / "summary.json").read_text())
        measured = s["trajectories_trained"] / max(s["rl_wall_s"], 1e-9)
    engines = cfg.ray.engines if cfg.ray.enabled else 1
    curve = curve or default_curve()
    return RunProfile(run_dir, cfg, episodes, a, b, min(keep, 1.0), sync, measured, engines, curve, cores, env_cpu_s,
                      prefill_ratio, shared)  # fmt: skip


def _episodes(journal: Path) -> tuple[list[Episode], int]:
    """The run's finished episodes, and the prompt tokens every one of them starts with."""
    out = []
    shared: list[int] | None = None
    with journal.open() as f:
        for line in f:
            if not line.strip():
                continue
            t = json.loads(line)
            if t.get("status") == "error":
                continue
            shared = _common_start(shared, t)
            tokens = sum(sum(s.get("loss_mask", [])) for s in t.get("segments", []))
            turns = max(len(t.get("turns", [])), 1)
            env_s = float(t.get("timings", {}).get("env_s", 0.0))
            reward = float(t.get("reward") or 0.0)
            out.append(Episode(turns, max(tokens, 1), env_s, reward, _turn_tokens(t.get("turns", []))))
    if not out:
        raise PlanError(f"{journal} holds no finished episode")
    return out, len(shared or [])


def _common_start(shared: list[int] | None, t: dict[str, Any]) -> list[int]:
    """The longest common start of ``shared`` and this trajectory's first prompt."""
    segments, turns = t.get("segments") or [{}], t.get("turns") or [{}]
    prompt = segments[0].get("token_ids", [])[: (turns[0].get("span") or [0])[0]]
    if shared is None:
        return list(prompt)
    n = 0
    for a, b in zip(shared, prompt, strict=False):
        if a != b:
            break
        n += 1
    return shared[:n]


def _turn_tokens(turns: list[dict[str, Any]]) -> list[tuple[int, int, int]] | None:
    """(context, new, generated) tokens of each turn from its span in its segment; a turn that starts a new segment
    (a compacted or branched context) has all of its context new."""
    out: list[tuple[int, int, int]] = []
    end, segment = 0, None
    for turn in turns:
        span = turn.get("span")
        if not span or len(span) != 2:
            return None
        start, stop = int(span[0]), int(span[1])
        new = start - end if turn.get("segment") == segment else start
        out.append((start, max(new, 0), max(stop - start, 1)))
        end, segment = stop, turn.get("segment")
    return out or None


def _fit_line(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """Least squares ``y = a + b x`` with both terms kept non-negative (a flat x gives ``a = mean(y)``)."""
    mx, my = statistics.mean(x), statistics.mean(y)
    sxx = sum((v - mx) ** 2 for v in x)
    if sxx <= 1e-12:
        return my, 0.0
    b = max(0.0, sum((u - mx) * (v - my) for u, v in zip(x, y, strict=True)) / sxx)
    a = my - b * mx
    if a < 0:  # all of it proportional to samples
        return 0.0, my / mx if mx else 0.0
    return a, b


def default_curve(path: str | Path = "benchmarks/results/engine.json") -> dict[int, float]:
    """The embedded engine's batched-decode throughput by batch size, normalised to 1 at one request."""
    p = Path(path)
    if not p.is_file():
        raise PlanError(f"no engine throughput curve at {p}: run benchmarks/engine.py or pass one")
    tok_s = {int(k): float(v) for k, v in json.loads(p.read_text())["decode"]["embedded"].items()}
    return {n: v / tok_s[min(tok_s)] for n, v in sorted(tok_s.items())}


def default_prefill_ratio(path: str | Path = "benchmarks/results/engine.json") -> float | None:
    """The embedded engine's prefill rate over its single-request decode rate (None where the file lacks them)."""
    p = Path(path)
    if not p.is_file():
        return None
    d = json.loads(p.read_text())
    resume, decode = d.get("prefix_cache") or {}, d.get("decode", {}).get("embedded", {})
    if not resume.get("without_cache_s") or "1" not in decode:
        return None
    return resume["context_tokens"] / resume["without_cache_s"] / float(decode["1"])


def curve_at(curve: dict[int, float], n: int) -> float:
    """Throughput multiple at ``n`` concurrent requests: piecewise linear, flat past the last point."""
    points = sorted(curve.items())
    if n <= points[0][0]:
        return points[0][1] * n / points[0][0]
    for (n0, v0), (n1, v1) in zip(points, points[1:], strict=False):
        if n <= n1:
            return v0 + (v1 - v0) * (n - n0) / (n1 - n0)
    return points[-1][1]


# -------------------------------------------------------------------------------------------------- one simulation


class _StepClock:
    """The metrics logger's place in the loop: records each step's virtual end time instead of writing files."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def progress(self, it: Any, desc: str) -> Any:
        return it

    def step(self, step: int, **groups: Any) -> dict[str, float]:
        self.ends.append(asyncio.get_running_loop().time())
        return {}


def source_scenario(profile: RunProfile, speed: float, steps: int | None = None) -> Scenario:
    """The source run itself as a scenario (its mode, window, batch, engines; one trainer process)."""
    c = profile.cfg
    return Scenario(
        mode=c.run.mode,
        stale_steps=c.store.stale_steps,
        batch_groups=c.store.batch_groups,
        group_size=c.rollout.group_size,
        engines=profile.engines,
        trainer_gpus=1,
        steps=steps or c.run.steps,
        concurrency=max(1, c.rollout.max_concurrency // profile.engines),
        slots=c.engine.max_slots,
        speed=speed,
        seed=c.run.seed,
        cores=profile.cores,
        env_cpu_s=profile.env_cpu_s,
        trainer_threads=float(c.run.threads),
    )


def simulate(profile: RunProfile, sc: Scenario) -> SimResult:
    """Run the job's loop on a virtual clock with the scenario's simulated parts."""
    return run_virtual(_simulate(profile, sc))  # type: ignore[no-any-return]


async def _simulate(profile: RunProfile, sc: Scenario) -> SimResult:
    from agentflow.builder import Job, stale_steps
    from agentflow.controller import rl_loop

    loop = asyncio.get_running_loop()
    assert isinstance(loop, VirtualLoop), "simulate() runs on a VirtualLoop"
    mode, _, extra = sc.mode.partition("+")
    overrides = [f"run.mode={mode}", f"run.steps={sc.steps}", f"store.batch_groups={sc.batch_groups}",
                 f"store.stale_steps={sc.stale_steps}", f"rollout.group_size={sc.group_size}",
                 "run.checkpoint_every=0", "eval.every_steps=0", "trainer.drop_uniform_groups=false",
                 "run.progress=false", "trainer.kl_coef=0"]  # fmt: skip
    overrides += REPLAY if extra == "replay" else []
    cfg = load_config(profile.run_dir / "config.yaml", overrides)
    c = profile.curve
    cpu = Cpu(sc.cores)
    prefill = sc.speed * profile.prefill_ratio if profile.prefill_ratio else None
    engines = [SimEngine(lambda n: sc.speed * curve_at(c, n), sc.slots, cpu, prefill) for _ in range(sc.engines)]
    scale = profile.keep_frac / sc.trainer_gpus**sc.dp_exponent
    trainer = SimTrainer(lambda k: profile.train_a + profile.train_b * k * scale, cpu, sc.trainer_threads)
    store = TrajectoryStore(
        sc.batch_groups, stale_steps(cfg), None, cfg.store.collect, cfg.store.length_aware, cfg.store.replay
    )
    e = cfg.engine
    kv = KvPolicy(e.prefix_cache, (e.kv_max_age or 0) if e.kv_on_update == "keep" else 0, profile.shared_prefix)
    rollouts = SimRollouts(profile.episodes, engines, sc.concurrency * sc.engines, sc.seed, cpu, sc.env_cpu_s, kv)
    clock = _StepClock()
    with tempfile.TemporaryDirectory() as tmp:
        job = Job(cfg, Path(tmp), Path(tmp), trainer, engines[0], SimTransport(engines, profile.sync_s), None,  # type: ignore[arg-type]
                  SimMixture(), store, None, rollouts, clock, BusyTracker())  # type: ignore[arg-type]  # fmt: skip
        start = loop.time()
        result = await rl_loop(job)
    wall = max(loop.time() - start, 1e-9)
    m = store.metrics()
    busy = sum(b - a for a, b in trainer.busy)
    replays = sum(result.replay_counts.values())
    work = sum(trainer.step_s(k) for k in trainer.samples)
    return SimResult(
        samples_per_s=len(result.trained_ids) / wall,
        wall_s=wall,
        trajectories_trained=len(result.trained_ids),
        mean_staleness=float(m["mean_staleness"]),
        max_staleness_seen=int(m["max_staleness_seen"]),
        engine_idle_fraction=1 - statistics.mean(e.busy_s for e in engines) / wall,
        trainer_idle_fraction=1 - busy / wall,
        trainer_stretch=busy / work if work else 1.0,
        steady_samples_per_s=_steady(clock.ends, len(result.trained_ids), wall),
        updates_per_s=result.steps / wall,
        replayed_share=replays / max(replays + store.fresh_taken, 1),
        prefix_reuse=_reuse(engines),
    )


def _reuse(engines: Sequence[SimEngine]) -> float | None:
    """Share of the simulated prompts' tokens the engines' prefix caches supplied (None: no prompts)."""
    prompt = sum(e.prompt_tokens for e in engines)
    return 1 - sum(e.prefilled for e in engines) / prompt if prompt else None


def _steady(ends: list[float], trained: int, wall: float) -> float:
    if len(ends) < 2:
        return trained / wall
    per_step = trained / len(ends)
    return per_step * (len(ends) - 1) / max(ends[-1] - ends[0], 1e-9)


# ----------------------------------------------------------------------------------------------------- calibration


def calibrate(profile: RunProfile, steps: int | None = None, iters: int = 14) -> tuple[RunProfile, float]:
    """Fit the run: the engines' single-request decode rate (tokens/s) at which the simulated source run trains its
    measured samples/s (bisection on a log scale), and, where the parts shared cores, the trainer's cost at full
    speed (its measured step times divided by the stretch the simulation gives them; a fixed point, two rounds).

    Returns the profile with the trainer's full-speed cost, and the rate."""
    target = profile.measured_samples_per_s
    if target is None:
        raise PlanError(f"{profile.run_dir} has no summary.json: calibrating needs the run's measured samples/s")
    if profile.cores is None:
        return profile, _fit_speed(profile, target, steps, iters)
    measured_a, measured_b = profile.train_a, profile.train_b
    # the start: no contention (the measured step times, stretched by contention already, would be stretched twice)
    speed = _fit_speed(replace(profile, cores=None), target, steps, iters)
    for _ in range(2):
        stretch = simulate(profile, source_scenario(profile, speed, steps)).trainer_stretch
        profile = replace(profile, train_a=measured_a / stretch, train_b=measured_b / stretch)
        speed = _fit_speed(profile, target, steps, iters)
    return profile, speed


LATENCY_BOUND_SLACK = 0.05
"""A run within this fraction of what infinitely fast engines would train is latency-bound: its engine speed is
fitted to 99% of that bound (the slowest engines that keep it), and the episode draw's own noise is forgiven."""


def _fit_speed(profile: RunProfile, target: float, steps: int | None, iters: int) -> float:
    lo, hi = 1.0, 1e6
    fastest = simulate(profile, source_scenario(profile, hi, steps)).samples_per_s
    if fastest < target * (1 - LATENCY_BOUND_SLACK):
        raise PlanError(
            f"even infinitely fast engines train {fastest:.2f} samples/s < the measured {target:.2f}: the run's "
            "environment times and trainer steps alone are too slow to explain it"
        )
    target = min(target, 0.99 * fastest)
    for _ in range(iters):
        mid = (lo * hi) ** 0.5
        if simulate(profile, source_scenario(profile, mid, steps)).samples_per_s < target:
            lo = mid
        else:
            hi = mid
    return (lo * hi) ** 0.5


# ------------------------------------------------------------------------------------------------------ the table


MODES = ("sync", "one_step", "async", "async+replay")
#: what ``async+replay`` adds to async: the store's adaptive replay (the staleness bound is the run's own)
REPLAY = ["store.replay.max_reuse=2", "store.replay.ratio=0.75", "store.replay.schedule=adaptive"]


def predict(profile: RunProfile, speed: float, mode: str, steps: int | None = None) -> SimResult:
    """The source run's job in another ``run.mode`` (same engines, batch and window setting)."""
    return simulate(profile, replace(source_scenario(profile, speed, steps), mode=mode))


def best_split(
    profile: RunProfile,
    speed: float,
    gpus: int,
    mode: str,
    steps: int,
    trainer_options: Sequence[int] | None = None,
    max_batch_groups: int = 1024,
) -> dict[str, Any]:
    """Simulate ``gpus`` devices split between trainer and engines in ``mode``; the split with the most steady-state
    samples/s. Trainer GPUs: powers of two from a sixteenth to half of the devices, then, while the best split is
    at an end of what was tried, halfway further towards that end (down to 1 trainer GPU, up to 1 engine), so the
    recommendation is never an artefact of the range.

    The batch grows with the cluster (``batch_groups * gpus / source devices``, at most ``max_batch_groups``), so every
    split trains the same batch and only the split differs."""
    base = source_scenario(profile, speed, steps)
    source_devices = profile.engines + 1
    batch = min(max(base.batch_groups, round(base.batch_groups * gpus / source_devices)), max_batch_groups)
    options = trainer_options or [t for t in _powers_of_two(gpus // 2) if t >= max(1, gpus // 16)]
    tried: dict[int, dict[str, Any]] = {}

    def run(t: int) -> None:
        sc = replace(base, mode=mode, engines=gpus - t, trainer_gpus=t, batch_groups=batch)
        tried[t] = {"trainer_gpus": t, "engines": gpus - t, **simulate(profile, sc).as_dict()}

    for t in options:
        run(t)
    while trainer_options is None:
        best = max(tried.values(), key=lambda r: r["steady_samples_per_s"])["trainer_gpus"]
        lo, hi = min(tried), max(tried)
        nxt = (hi + (gpus - hi + 1) // 2) if best == hi else (lo // 2 if best == lo else 0)
        if nxt in tried or not 1 <= nxt <= gpus - 1:
            break
        run(nxt)
    rows = [tried[t] for t in sorted(tried)]
    best_row = max(rows, key=lambda r: r["steady_samples_per_s"])
    return {"gpus": gpus, "mode": mode, "batch_groups": batch, "best": best_row, "tried": rows}


def _powers_of_two(limit: int) -> list[int]:
    out, p = [], 1
    while p <= max(limit, 1):
        out.append(p)
        p *= 2
    return out


def plan(
    profile: RunProfile,
    speed: float,
    gpus: Sequence[int] = (8, 64, 1024),
    steps: int = 6,
    modes: Sequence[str] = ("sync", "async"),
    max_batch_groups: int = 1024,
) -> dict[str, Any]:
    """Predictions at each cluster size and mode, with the recommended rollout:training split."""
    rows = [
        best_split(profile, speed, n, mode, steps, max_batch_groups=max_batch_groups) for n in gpus for mode in modes
    ]
    return {
        "source": str(profile.run_dir),
        "engine_speed_tokens_per_s": speed,
        "steps_simulated": steps,
        "rows": rows,
        "replay": " ".join(REPLAY) + " (async+replay)",
    }


def run_plan(args: Any) -> int:
    """``agentflow plan RUN_DIR``: calibrate on the run, predict its job in each mode here, then the cluster table."""
    import sys

    try:
        curve = default_curve(args.curve) if args.curve else default_curve(_REPO / "benchmarks/results/engine.json")
        cores = None if args.cores is None else measure_effective_cores() if args.cores == "auto" else float(args.cores)
        engine_json = args.curve or _REPO / "benchmarks/results/engine.json"
        profile = load_profile(args.run_dir, curve, cores, args.env_cpu_s, default_prefill_ratio(engine_json))
        if args.speed:
            speed = args.speed
        else:
            profile, speed = calibrate(profile)
        gpus = [int(g) for g in str(args.gpus).split(",") if g.strip()]
        modes = [m.strip() for m in str(args.modes).split(",") if m.strip()]
        bad = [m for m in modes if m not in MODES]
        if bad:
            raise PlanError(f"--modes: unknown mode(s) {bad}; known: {', '.join(MODES)}")
        here = {m: predict(profile, speed, m).as_dict() for m in modes}
        out = {
            "measured": {"mode": profile.mode, "samples_per_s": profile.measured_samples_per_s},
            "this_machine": here,
            **plan(profile, speed, gpus, args.steps, modes),
        }
    except PlanError as e:
        print(f"agentflow: error: {e}", file=sys.stderr)
        return 2
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(_brief(out), indent=2))
    return 0


_REPO = Path(__file__).resolve().parent.parent


def _brief(out: dict[str, Any]) -> dict[str, Any]:
    """The console's view of a plan: per mode here, and per cluster size the best split."""
    rows = {
        f"{r['gpus']} gpus {r['mode']}": {
            "trainer_gpus": r["best"]["trainer_gpus"],
            "engines": r["best"]["engines"],
            "samples_per_s": round(r["best"]["steady_samples_per_s"], 2),
            "mean_staleness": round(r["best"]["mean_staleness"], 2),
        }
        for r in out["rows"]
    }
    here = {m: round(v["samples_per_s"], 3) for m, v in out["this_machine"].items()}
    return {"measured": out["measured"], "predicted_here": here, "engine_speed": out["engine_speed_tokens_per_s"],
            "clusters": rows}  # fmt: skip
