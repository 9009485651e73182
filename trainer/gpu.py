"""The GPU path of the Megatron trainer: Megatron's DistributedDataParallel and its distributed optimizer.

Run on one NVIDIA H200 with megatron-core 0.16.1 (world size 1, fp32, local layer spec): three steps match the CPU
trainer's losses, grad norms and weights (``benchmarks/gpu_check.py``). DP/TP > 1, bf16 and the optimizer's
``state_dict`` round trip (checkpoints) have not been run on GPUs. On CPU both hard-code CUDA (docs/decisions.md),
so the CPU path keeps plain ``torch.optim.AdamW``.

:class:`MegatronOptimizerAdapter` gives the Megatron optimizer the surface the trainer uses on CPU (``zero_grad``,
``clip_grad_norm_``, ``step``, ``param_groups``, ``state_dict``/``load_state_dict``), so ``train_step`` is one code
path:

- ``zero_grad`` also zeroes DDP's contiguous grad buffers (where backward accumulates ``main_grad``);
- the trainer's ``_dp_allreduce_grads`` calls DDP's ``finish_grad_sync`` (reduce-scatter for the distributed
  optimizer; a sum, since ``calculate_per_token_loss`` turns off DDP's 1/DP scaling);
- ``clip_grad_norm_`` runs Megatron's ``prepare_grads`` then clips by the global norm (Megatron's own TP/DP-aware
  ``get_grad_norm``); ``step`` runs ``step_with_ready_grads`` (update + parameter all-gather);
- the LR schedule drives the inner torch optimizer (:attr:`torch_optimizer`), as Megatron's scheduler does.

Weight decay applies to every parameter, as with the CPU AdamW: the optimizer is built with ``config_overrides={}``
(Megatron's standard overrides would mark norms and biases ``wd_mult=0``, which only its own LR scheduler applies).
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.types import TrainerSettings

__all__ = ["MegatronOptimizerAdapter", "wrap_ddp", "wrap_for_gpu"]


def wrap_ddp(model: torch.nn.Module, distributed_optimizer: bool = True) -> torch.nn.Module:
    """Megatron ``DistributedDataParallel`` around ``model`` (fp32 grad reduction, no overlap, no bucketing tricks)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
        use_distributed_optimizer=distributed_optimizer,
    )
    config = model.config
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)


class MegatronOptimizerAdapter:
    """Megatron's (distributed) optimizer behind the torch-optimizer surface the trainer uses."""

    def __init__(self, ddp_model: torch.nn.Module, settings: TrainerSettings, bf16: bool = False) -> None:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        config = OptimizerConfig(
            optimizer="adam",
            lr=settings.lr,
            min_lr=0.0,
            weight_decay=settings.weight_decay,
            adam_beta1=0.9,
            adam_beta2=0.99,
            adam_eps=1e-8,
            clip_grad=settings.grad_clip,
            bf16=bf16,
            params_dtype=torch.bfloat16 if bf16 else torch.float32,
            use_distributed_optimizer=True,
        )
        self.ddp_model = ddp_model
        self.megatron_optimizer = get_megatron_optimizer(config, [ddp_model], config_overrides={})
        self._prepared = False
        self._found_inf = False

    @property
    def _parts(self) -> list[Any]:
        return list(getattr(self.megatron_optimizer, "chained_optimizers", [self.megatron_optimizer]))

    @property
    def torch_optimizer(self) -> torch.optim.Optimizer:
        """The inner torch optimizer whose ``param_groups[i]["lr"]`` the LR schedule sets."""
        parts = [p for p in self._parts if not getattr(p, "is_stub_optimizer", False)]
        if len(parts) != 1:
            raise RuntimeError(f"expected one non-stub Megatron optimizer, found {len(parts)}")
        return parts[0].optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.megatron_optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero DDP's grad buffers and the optimizer's gradients."""
        self.ddp_model.zero_grad_buffer()
        self.megatron_optimizer.zero_grad(set_to_none)
        self._prepared = False

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> float:
        """Bring the synced grads to the optimizer (``prepare_grads``), clip by the global norm; returns the norm."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        self._prepare()
        norm = float(self.megatron_optimizer.get_grad_norm())
        if max_norm > 0 and not self._found_inf:
            for part in self._parts:
                params = part.get_parameters() if not getattr(part, "is_stub_optimizer", False) else []
                if params:
                    clip_grad_by_total_norm_fp32(params, max_norm, norm)
        return norm

    def _prepare(self) -> None:
        if not self._prepared:
            self._found_inf = bool(self.megatron_optimizer.prepare_grads())
            self._prepared = True

    @torch.no_grad()
    def step(self) -> bool:
        """Update the parameters (and all-gather them across DP); False when inf/nan grads skipped the update."""
        self._prepare()
        self._prepared = False
        if self._found_inf:
            return False
        return bool(self.megatron_optimizer.step_with_ready_grads())

    def state_dict(self) -> dict[str, Any]:
        """Megatron's optimizer state plus, for distributed optimizers, the DP-gathered parameter state (collective)."""
        params = [
            p.get_parameter_state_dp_zero() if hasattr(p, "get_parameter_state_dp_zero") else None for p in self._parts
        ]
        return {"megatron": self.megatron_optimizer.state_dict(), "param_state": params}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict`."""
        self.megatron_optimizer.load_state_dict(state["megatron"])
        for part, param_state in zip(self._parts, state["param_state"], strict=True):
            if param_state is not None:
                part.load_parameter_state_from_dp_zero(param_state)


def wrap_for_gpu(
    model: torch.nn.Module, settings: TrainerSettings, bf16: bool = False
) -> tuple[torch.nn.Module, MegatronOptimizerAdapter]:
    """``(DDP model, optimizer adapter)`` for a CUDA model built by ``trainer.model.build_gpt_model``."""
    ddp = wrap_ddp(model, distributed_optimizer=True)
    return ddp, MegatronOptimizerAdapter(ddp, settings, bf16=bf16)
