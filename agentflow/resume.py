"""Lossless resume: the newest complete checkpoint plus the journal of accepted trajectories restore a run.

A checkpoint records the ids of every trajectory trained up to it (``extra["trained_ids"]``); the journal records
every accepted one. Resuming loads the checkpoint into the trainer and puts the journaled groups that are not in its
list back into the store, in dispatch order, ahead of anything new. So no accepted trajectory is lost (it is either
in the list or restored) and none is trained twice (the restored ones are exactly those not in the list; steps the
crashed trainer took after its last checkpoint are lost together with their weights, so their groups train again).
With replay on, the checkpoint also records the replay pool (group id -> replays so far) and how many fresh groups
were trained; those groups come back from the journal into the pool with their counts, so no group is trained more
than ``1 + max_reuse`` times in the checkpoint's lineage.

Checkpoints are written to a temporary file and renamed (trainer side), so a crash during a write leaves a ``.tmp``
file that is ignored here; a checkpoint that does not load is skipped for the one before it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentflow.store import Journal
from agentflow.types import Group, Trajectory

_STEP = re.compile(r"^step_(\d+)\.pt$")


class ResumeError(RuntimeError):
    """A run directory cannot be resumed; the message says why."""


@dataclass
class ResumeState:
    """Where a resumed run starts: the trainer step, what was trained, what goes back into the store."""

    checkpoint: Path | None
    step: int = 0
    trained_ids: list[str] = field(default_factory=list)
    groups: list[Group] = field(default_factory=list)
    next_group_index: int = 0
    skipped_checkpoints: list[str] = field(default_factory=list)
    fresh_groups: int | None = None
    """Fresh groups trained up to the checkpoint (None: an older checkpoint, ``B`` per step)."""
    replayable: list[tuple[Group, int]] = field(default_factory=list)
    """The checkpoint's replay pool: groups that may be trained again and their replays so far."""
    replay_counts: dict[str, int] = field(default_factory=dict)
    """Group id -> times trained again, over the checkpoint's lineage."""
    generated_tokens: int = 0
    """Model tokens of every journaled trajectory (what ``run.max_generated_tokens`` has spent so far)."""


def group_index(group_id: str) -> int:
    """Dispatch index of a group id ``g<n>`` (the feeder names groups by their index)."""
    if not (group_id.startswith("g") and group_id[1:].isdigit()):
        raise ResumeError(f"journal holds a group id {group_id!r} not written by the feeder (expected g<n>)")
    return int(group_id[1:])


def checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, newest first (``.tmp`` leftovers of a crashed write are not listed)."""
    found = []
    for p in (Path(run_dir) / "checkpoints").glob("step_*.pt"):
        m = _STEP.match(p.name)
        if m and p.is_file():
            found.append((int(m.group(1)), p))
    return sorted(found, reverse=True)


def load_latest(run_dir: str | Path, load: Callable[[str], dict[str, Any]]) -> tuple[Path | None, dict, list[str]]:
    """Load the newest checkpoint that loads (``load`` is the trainer's); returns its path, extra, skipped ones."""
    from trainer.launcher import TrainerCallError, TrainerError

    skipped = []
    for _, path in checkpoints(run_dir):
        try:
            return path, load(str(path)), skipped
        except TrainerCallError as e:  # the trainer is alive and could not read the file: fall back, and say so
            skipped.append(f"{path.name}: {str(e).strip().splitlines()[-1]}")
        except TrainerError:  # the trainer died, the file may be fine: falling back would retrain what it holds
            raise
        except Exception as e:  # noqa: BLE001 - a corrupt file: fall back to the one before, and say so
            skipped.append(f"{path.name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return None, {}, skipped


def untrained_groups(
    journal: list[Trajectory], trained: set[str], group_size: int, resume_version: int = 0
) -> tuple[list[Group], int]:
    """Journaled groups with no trained trajectory, in dispatch order, and the next free group index.

    A group is journaled whole in one write; a group with fewer trajectories than ``group_size`` is the torn last
    write of a crash (never acknowledged, never trained) and is not restored.
    """
    by_group: dict[str, list[Trajectory]] = {}
    for t in journal:
        by_group.setdefault(t.group_id, []).append(t)
    seen = [t.id for t in journal]
    if len(seen) != len(set(seen)):
        raise ResumeError("the journal holds a trajectory id twice; refusing to guess which copy is the real one")
    groups, next_index = [], 0
    for gid in sorted(by_group, key=group_index):
        trajs = by_group[gid]
        next_index = max(next_index, group_index(gid) + 1)
        done = [t.id in trained for t in trajs]
        if any(done) and not all(done):
            raise ResumeError(
                f"group {gid} is partly trained ({sum(done)} of {len(trajs)}): journal and checkpoint disagree"
            )
        if all(done) or len(trajs) < group_size:
            continue
        # dispatch_version only matters for a group without model tokens (all errored at once): the resume version
        groups.append(Group(id=gid, task_seed=-1, trajectories=trajs, dispatch_version=resume_version))
    return groups, next_index


def plan_resume(run_dir: str | Path, load: Callable[[str], dict[str, Any]], group_size: int) -> ResumeState:
    """Load the trainer's newest good checkpoint and compute what the store gets back."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ResumeError(f"{run_dir} is not a run directory (no config.yaml)")
    path, extra, skipped = load_latest(run_dir, load)
    trained = list(extra.get("trained_ids", []))
    if len(trained) != len(set(trained)):
        raise ResumeError(f"checkpoint {path} lists a trajectory as trained twice")
    step = int(extra.get("step", 0))
    journal = Journal.read(run_dir / "journal.jsonl")
    version = int(extra.get("version", step))
    groups, next_index = untrained_groups(journal, set(trained), group_size, version)
    fresh = None if extra.get("fresh_groups") is None else int(extra["fresh_groups"])
    replayable = replay_pool(journal, set(trained), dict(extra.get("replay", {})), version)
    counts = {str(k): int(v) for k, v in dict(extra.get("replay_counts", {})).items()}
    spent = sum(t.num_model_tokens() for t in journal)
    return ResumeState(path, step, trained, groups, next_index, skipped, fresh, replayable, counts, spent)


def replay_pool(
    journal: list[Trajectory], trained: set[str], replays: dict[str, int], version: int
) -> list[tuple[Group, int]]:
    """The checkpoint's replay pool rebuilt from the journal: every group it names must be there, wholly trained."""
    by_group: dict[str, list[Trajectory]] = {}
    for t in journal:
        if t.group_id in replays:
            by_group.setdefault(t.group_id, []).append(t)
    out = []
    for gid, n in replays.items():
        trajs = by_group.get(gid, [])
        if not trajs or not all(t.id in trained for t in trajs):
            raise ResumeError(f"checkpoint's replay pool names group {gid}, which the journal does not hold as trained")
        out.append((Group(id=gid, task_seed=-1, trajectories=trajs, dispatch_version=version), int(n)))
    return out
