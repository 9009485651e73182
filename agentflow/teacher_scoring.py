"""The job's side of the Teacher Manager: scorers for teachers (embedded engines or SGLang servers), the manager
built from the ``teachers`` section, and the step that attaches teacher log-probs to a batch's samples.

``teachers/`` knows nothing of engines or trajectories; this module is where the two meet.
"""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Callable

from agentflow.config import JobConfig
from agentflow.types import Group, ScoreResult
from teachers.manager import TeacherManager
from teachers.routing import Router
from teachers.types import Scorer, ScoreRequest, TeacherSpec
from trainer.types import Sample


def teacher_specs(cfg: JobConfig) -> list[TeacherSpec]:
    """The configured teachers (a :class:`~teachers.types.TeacherError` names an unusable entry)."""
    return [TeacherSpec(m.name, m.path, m.url, m.tokenizer) for m in cfg.teachers.models]


def route_tags(source_tags: tuple[str, ...] | list[str], source_name: str) -> list[str]:
    """What a sequence is routed on: its data source's tags, then the source's name."""
    return [*source_tags, source_name]


class EngineScorer:
    """A teacher loaded into an embedded engine (no KV cache to speak of: scoring runs full forward passes)."""

    def __init__(self, path: str) -> None:
        from agentflow.engine.embedded import EmbeddedEngine

        self.engine: EmbeddedEngine | None = EmbeddedEngine(path, max_slots=1, max_len=16, prefix_cache=False)

    def score(self, ids: list[int], start: int, top_k: int = 0) -> ScoreResult:
        if self.engine is None:
            raise RuntimeError("EngineScorer.score after close()")
        return self.engine.score(ids, start, top_k)

    def close(self) -> None:
        """Stop the engine and hand its memory back to the OS (glibc keeps freed heap pages otherwise, and a
        released teacher would still count against the machine)."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        gc.collect()
        _malloc_trim()


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def make_scorer_factory(cfg: JobConfig) -> Callable[[TeacherSpec], Scorer]:
    """Teachers load into embedded engines (``path``) or talk to SGLang-protocol servers (``url``)."""

    def factory(spec: TeacherSpec) -> Scorer:
        if spec.path is not None:
            return EngineScorer(spec.path)
        from agentflow.engine.sglang_client import SGLangEngine

        return SGLangEngine([str(spec.url)], request_timeout=cfg.engine.request_timeout)

    return factory


def make_manager(
    cfg: JobConfig, router: Router, factory: Callable[[TeacherSpec], Scorer] | None = None
) -> TeacherManager:
    t = cfg.teachers
    top_k = t.top_k if t.loss_coef > 0 and t.loss_estimator == "topk" else 0
    return TeacherManager(
        teacher_specs(cfg), router, factory or make_scorer_factory(cfg), t.max_resident, t.release, top_k
    )


def attach_teacher_scores(manager: TeacherManager, batch: list[Group], samples: list[Sample]) -> None:
    """Score every sample with its data source's teacher(s); store the log-probs aligned with its tokens."""
    trajs = {t.id: t for g in batch for t in g.trajectories}
    requests = []
    for s in samples:
        traj = trajs[s.sample_id.rsplit("/", 1)[0]]  # to_samples names rows "TRAJECTORY_ID/SEGMENT"
        requests.append(ScoreRequest(s.sample_id, s.token_ids, route_tags(traj.tags, traj.data_source), 1))
    for s, scores in zip(samples, manager.score(requests), strict=True):
        s.teacher_logprobs = [0.0, *scores.logprobs]
        if scores.top_ids is not None and scores.top_logprobs is not None:
            s.teacher_top_ids = [[], *scores.top_ids]
            s.teacher_top_logprobs = [[], *scores.top_logprobs]
        s.extra["teachers"] = scores.teachers
        if len(scores.teachers) == 1:  # whose full distributions the trainer compares with (full-vocabulary terms)
            s.teacher = next(iter(scores.teachers))
