"""Small file helpers shared by the job's writers."""

from __future__ import annotations

import json
import os
from pathlib import Path


def dump_json(path: str | Path, obj: object) -> None:
    """Write ``obj`` as indented JSON, replacing ``path`` atomically (a reader never sees half a file)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True))
    tmp.replace(out)
