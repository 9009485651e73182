"""One teacher: its spec, pre-flight checks (model present, tokenizer identical to the student's), residency.

Distillation compares the teacher's and the student's log-probs of the *same token ids*, so a teacher must use the
student's tokenizer exactly: the same vocabulary (string -> id), merges, special tokens and pre-tokenization. The
check reads ``tokenizer.json`` files only, so it is cheap enough to run before anything is loaded.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

from teachers.types import Offloadable, ReleaseMode, Scorer, ScorerFactory, TeacherError, TeacherSpec

_TOKENIZER_PARTS = ("model", "added_tokens", "pre_tokenizer", "normalizer")


def _tokenizer_json(directory: str | Path, owner: str) -> dict[str, Any]:
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise TeacherError(f"{owner}: no tokenizer.json in {directory}")
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise TeacherError(f"{owner}: cannot read {path}: {e}") from e


def tokenizer_fingerprint(directory: str | Path, owner: str = "model") -> str:
    """A hash of what decides token ids: the BPE model (vocab + merges), added tokens, pre-tokenizer, normalizer."""
    data = _tokenizer_json(directory, owner)
    parts = {k: data.get(k) for k in _TOKENIZER_PARTS}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _tokenizer_difference(a: dict[str, Any], b: dict[str, Any]) -> str:
    """A short human description of how two tokenizer.json files differ."""
    va, vb = (a.get("model") or {}).get("vocab") or {}, (b.get("model") or {}).get("vocab") or {}
    if len(va) != len(vb):
        return f"vocabulary sizes {len(vb)} vs {len(va)}"
    moved = [tok for tok, i in vb.items() if va.get(tok) != i]
    if moved:
        return f"{len(moved)} tokens have other ids (e.g. {moved[0]!r})"
    for part in _TOKENIZER_PARTS:
        if a.get(part) != b.get(part):
            return f"their {part.replace('_', '-')} settings differ"
    return "unknown difference"


def check_teacher(spec: TeacherSpec, student_dir: str | Path) -> None:
    """Raise :class:`TeacherError` unless the teacher exists and shares the student's tokenizer."""
    owner = f"teacher {spec.name!r}"
    if spec.path is not None:
        path = Path(spec.path)
        if not path.is_dir():
            raise TeacherError(f"{owner}: model directory not found: {path}")
        if not (path / "config.json").is_file():
            raise TeacherError(f"{owner}: {path} has no config.json (not a Hugging Face model directory)")
    tok_dir = spec.tokenizer_dir
    if tok_dir is None:
        raise TeacherError(
            f"{owner}: a server teacher ({spec.url}) needs `tokenizer:` (a directory with its tokenizer.json) so "
            "that it can be checked against the student's before the job starts"
        )
    mine, student = _tokenizer_json(tok_dir, owner), _tokenizer_json(student_dir, "student")
    if tokenizer_fingerprint(tok_dir, owner) != tokenizer_fingerprint(student_dir, "student"):
        raise TeacherError(
            f"{owner}: its tokenizer ({tok_dir}) differs from the student's ({student_dir}): "
            f"{_tokenizer_difference(mine, student)}. Distillation compares log-probs of the same token ids, so "
            "teachers must use the student's tokenizer (build them from the student's tokenizer directory)."
        )


class Teacher:
    """A teacher and its residency: ``scorer`` is set while it is loaded (or parked, when offloaded)."""

    def __init__(self, spec: TeacherSpec, factory: ScorerFactory) -> None:
        self.spec = spec
        self.factory = factory
        self.scorer: Scorer | None = None
        self.offloaded = False
        self.last_used = 0.0

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def resident(self) -> bool:
        return self.scorer is not None and not self.offloaded

    def acquire(self) -> tuple[Scorer, str]:
        """The live scorer, loading or restoring it first; returns it and what was done (``""``/load/restore)."""
        action = ""
        if self.scorer is None:
            try:
                self.scorer = self.factory(self.spec)
            except Exception as e:
                raise TeacherError(f"teacher {self.name!r}: loading failed: {e}") from e
            action = "load"
        elif self.offloaded:
            assert isinstance(self.scorer, Offloadable)
            self.scorer.restore()
            self.offloaded = False
            action = "restore"
        self.last_used = time.monotonic()
        return self.scorer, action

    def release(self, mode: ReleaseMode) -> None:
        """Leave memory: ``free`` closes the scorer (weights stay on disk); ``offload`` parks them."""
        if self.scorer is None or self.offloaded:
            return
        if mode == "offload":
            if not isinstance(self.scorer, Offloadable):
                raise TeacherError(f"teacher {self.name!r}: its scorer cannot offload (use release: free)")
            self.scorer.offload()
            self.offloaded = True
            return
        scorer, self.scorer = self.scorer, None
        scorer.close()

    def close(self) -> None:
        scorer, self.scorer = self.scorer, None
        self.offloaded = False
        if scorer is not None:
            scorer.close()
