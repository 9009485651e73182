"""Reading a Hugging Face model directory: ``config.json`` -> :class:`ModelSpec`, ``*.safetensors`` -> tensors.

The one reader for the inference engine and the trainer alike, so both see the same architecture facts and the same
tensors from a directory. It lives in transfer_mesh because both may import it (``trainer`` imports only
transfer_mesh). Tensors come back as stored (dtype and all); each consumer casts or converts them itself. Writing an
HF directory stays with the trainer, which is the only side that exports one.
"""

from __future__ import annotations

import json
from pathlib import Path

from torch import Tensor

from transfer_mesh.layouts import LayoutError, ModelSpec

__all__ = ["ModelSpec", "load_hf_dir", "read_config", "read_weights", "weight_files"]


def _config_path(root: Path) -> Path:
    if not root.is_dir():
        raise FileNotFoundError(f"HF model directory not found: {str(root)!r}")
    path = root / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in HF model directory {str(root)!r}")
    return path


def weight_files(path: str | Path) -> list[Path]:
    """The directory's ``*.safetensors`` files in name order; FileNotFoundError when there are none."""
    root = Path(path)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in HF model directory {str(root)!r}")
    return files


def read_config(path: str | Path) -> ModelSpec:
    """The architecture of the model in directory ``path``, from its ``config.json``.

    ValueError for what no model code here implements (see :meth:`ModelSpec.from_hf_config`).
    """
    return ModelSpec.from_hf_config(json.loads(_config_path(Path(path)).read_text()))


def read_weights(path: str | Path) -> dict[str, Tensor]:
    """Every tensor of the directory's ``*.safetensors`` files by name, as stored.

    A name found in two files is a LayoutError: which copy is meant cannot be told.
    """
    from safetensors.torch import load_file  # imported here: reading a config needs no safetensors

    state: dict[str, Tensor] = {}
    for file in weight_files(path):
        for name, tensor in load_file(str(file)).items():
            if name in state:
                raise LayoutError(f"tensor {name} appears in more than one file of {str(path)!r}")
            state[name] = tensor
    return state


def load_hf_dir(path: str | Path) -> tuple[ModelSpec, dict[str, Tensor]]:
    """``(architecture, tensors)`` of an HF model directory.

    Missing pieces are reported before the config is parsed (directory, then ``config.json``, then weights), so an
    empty or half-copied directory names what is missing rather than failing on a config field.
    """
    root = Path(path)
    _config_path(root)
    weight_files(root)
    return read_config(root), read_weights(root)
