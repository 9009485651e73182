"""Lets the registry's torchvision import next to a CPU-only torch (loaded by a ``.pth`` file of the SGLang test venv).

The torchvision wheel is linked against CUDA torch, so its compiled ops do not load here, and its meta registrations
then fail on the missing ``torchvision::nms`` schema. Declaring the two schemas first is enough for ``import
torchvision``: SGLang's text-only path uses torchvision's constants, never its image ops. Active only in processes
started with ``SGLANG_USE_CPU_ENGINE=1`` (the CPU test server).
"""

import os

if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    import torch

    for _op in ("nms", "qnms"):
        try:
            torch.library.define(f"torchvision::{_op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        except RuntimeError:  # already declared (the real library loaded after all)
            pass
