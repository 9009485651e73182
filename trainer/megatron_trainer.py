"""The Megatron trainer, in-process: a megatron-core ``GPTModel`` loaded from an HF directory, AdamW, the losses.

On CPU Megatron's DDP and distributed optimizer hard-code CUDA (docs/decisions.md), so this path uses AdamW with
clipping by the global (TP-aware) gradient norm; with CUDA it uses Megatron's DDP and distributed optimizer
(trainer/gpu.py; run on one GPU by benchmarks/gpu_check.py). Each :meth:`train_step` is one training step (usually
one optimizer step, gradient accumulation across micro-batches) and bumps the weight version by one. Under TP/DP
(trainer/launcher.py's ParallelTrainerGroup) every rank runs this class; the DP hooks shard samples and sum gradients
and metrics.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer import moe, registry
from trainer.batching import MicroBatch, collate_vocab_masks, make_micro_batches
from trainer.critic import Critic, GAEPlan, critic_rows
from trainer.dist import dp_rank_and_size, init_distributed
from trainer.full_distill import full_vocab_terms, load_teachers, teacher_groups
from trainer.losses import LossInputs, plan_advantages, policy_loss, sft_loss
from trainer.model import (
    build_gpt_model,
    export_hf_state,
    load_hf_dir,
    load_into_model,
    save_hf_dir,
    supports_packing,
    token_logprobs,
    token_logprobs_and_entropy,
    token_logprobs_at,
    unwrap_model,
)
from trainer.parallel import ParallelAdamW, allreduce_grads, allreduce_sum, allreduce_tp_partial_grads, shard_for_dp
from trainer.types import LossSettings, Sample, TrainerSettings
from transfer_mesh.buckets import Bucket, pack_version


def lr_factor(step: int, settings: TrainerSettings) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio`` over ``decay_steps`` (constant when 0)."""
    warm = settings.warmup_steps
    if warm and step < warm:
        return (step + 1) / warm
    if not settings.decay_steps:
        return 1.0
    progress = min(1.0, (step - warm) / settings.decay_steps)
    return settings.min_lr_ratio + (1 - settings.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class MegatronTrainer:
    """One trainer rank (of a TP x DP group, or alone)."""

    def __init__(
        self,
        model_dir: str | Path,
        settings: TrainerSettings,
        tp: int = 1,
        dp: int = 1,
        device: str | None = None,
        bf16: bool = False,
        layer_spec: str = "auto",
        ep: int = 1,
    ) -> None:
        """Load ``model_dir`` into a megatron ``GPTModel`` on this rank.

        ``tp`` x ``dp`` must be the world size (torchrun-style variables, which ``trainer.launcher``'s parallel group
        sets; a world of 1 without them). ``device``: ``cpu`` or ``cuda`` (default: ``cuda`` when available). On CUDA
        the model is wrapped in Megatron's DDP and stepped by its distributed optimizer (``trainer.gpu``; run on
        one GPU in fp32 with the local spec); on CPU by AdamW whose ``clip_grad_norm_`` uses the global norm under
        TP. ``bf16`` and ``layer_spec`` (``auto``: TransformerEngine when installed, else megatron's local spec; see
        ``trainer.model``): CUDA only. ``ep``: a mixture-of-experts model's experts spread over ``ep`` ranks of each TP
        group (:func:`trainer.dist.init_distributed`).
        """
        torch.set_num_threads(settings.threads)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        init_distributed(tp=tp, dp=dp, backend="nccl" if self.device == "cuda" else "gloo", ep=ep)
        from megatron.core import parallel_state

        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.dp_rank, self.dp_size = dp_rank_and_size()
        self.last_dp_shard: list[int] = []
        """Indices (into the batch given to ``_dp_shard``) of the samples this DP rank trained on last."""
        self.model_dir = Path(model_dir)
        self.settings = settings
        self.spec, hf_state = load_hf_dir(model_dir)
        model = build_gpt_model(self.spec, settings.seed, self.device, bf16=bf16, layer_spec=layer_spec)
        load_into_model(model, hf_state, self.spec)
        if self.device == "cuda" and settings.max_step_kl is not None:
            raise ValueError(  # Megatron's optimizer keeps fp32 main weights that an in-place rescale would not reach
                "trainer.max_step_kl rescales a step in the model's own weights, which the GPU optimizer's main "
                "weights would overwrite: the CPU trainer only (leave it unset on GPUs)"
            )
        if self.device == "cuda":
            from trainer.gpu import wrap_for_gpu

            self.model, self.optimizer = wrap_for_gpu(model, settings, bf16=bf16)
            scheduled = self.optimizer.torch_optimizer
        else:
            self.model = model
            self.optimizer = ParallelAdamW(
                model.parameters(),
                tp_group=self.tp_group,
                lr=settings.lr,
                weight_decay=settings.weight_decay,
                betas=(0.9, 0.99),
            )
            scheduled = self.optimizer
        self.model.train()
        self.sequence_parallel = bool(unwrap_model(model).config.sequence_parallel)
        """Hidden states split along the sequence over the TP ranks (an MoE model under TP)."""
        loss = settings.loss
        if self.sequence_parallel and loss.distill_loss_estimator in registry.FULL_VOCAB_ESTIMATORS:
            raise ValueError(  # their chunked head reads each rank's hidden states as whole sequences
                f"trainer.distill_loss_estimator={loss.distill_loss_estimator} does not run under sequence "
                "parallelism (a mixture-of-experts model with trainer.tp > 1): use trainer.tp=1 and trainer.dp"
            )
        self.packing = settings.packing and supports_packing(model)
        """Whether micro-batches are packed (``settings.packing``, unless the layer spec cannot attend packed)."""
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(scheduled, partial(lr_factor, settings=settings))
        self.teachers: dict[str, torch.nn.Module] | None = None
        """Frozen teachers of the full-vocabulary distillation estimators (``trainer.full_distill``), by name; loaded
        by the first step that needs them (an imitation phase's trainer, which shares the job's settings, never
        does)."""
        self._bf16, self._layer_spec = bf16, layer_spec
        self.version = 0
        self.step = 0
        self.critic: Critic | None = None
        """PPO's value model (``trainer.critic``), built when the configured loss is ``ppo``."""
        if settings.loss.name == "ppo":
            schedule = partial(lr_factor, settings=settings)
            self.critic = Critic(self.spec, hf_state, settings, self._micro_batches, schedule, self.device, bf16,
                                 layer_spec, self.tp_group, self.dp_group, self.dp_size)  # fmt: skip

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.scheduler.base_lrs = [lr for _ in self.scheduler.base_lrs]

    # -- training ------------------------------------------------------------------------------------------------
    def train_step(self, samples: list[Sample], loss: str | None = None) -> dict[str, float]:
        """One training step (one weight version): usually one optimizer step, more with minibatches or turn credit.

        ``loss`` overrides the configured objective's name (``"sft"`` for warm-up). No samples (every group of the
        batch had zero advantage) is a no-op step: the weights stay, the version and the LR schedule still advance,
        so versions keep counting batches.
        """
        cfg = self.settings.loss
        if loss not in (None, cfg.name):
            cfg = cfg.model_copy(update={"name": registry.check("loss", loss)})
        if not samples:
            self.scheduler.step()
            if self.critic is not None:
                self.critic.scheduler.step()
            self.version += 1
            self.step += 1
            return {"skipped": 1.0, "samples": 0.0}
        t0 = time.perf_counter()
        plan = self._ppo_critic().plan(samples, cfg) if cfg.name == "ppo" else plan_advantages(samples, cfg)
        old = self._old_logprobs(samples) if cfg.recompute_old and cfg.name != "sft" else None
        single = len(plan.phases) == 1 and cfg.minibatches == 1
        totals: dict[str, float] = {}
        updates = 0
        for phase in plan.phases:
            # a phased update (turn-level credit) leaves out the samples with nothing to train in this phase: they
            # would add no gradient, only a forward and backward pass (the loss is averaged over trained tokens)
            active = [i for i in range(len(samples)) if len(plan.phases) == 1 or any(phase[i])]
            for part in _split(len(active), cfg.minibatches) if active else []:
                idx = [active[j] for j in part]
                rows = [(plan.advantages[i], phase[i], old[i] if old else None, *critic_rows(plan, i)) for i in idx]
                for k, v in self._update([samples[i] for i in idx], rows, cfg, single).items():
                    totals[k] = totals.get(k, 0.0) + v
                updates += 1
        self.version += 1
        self.step += 1
        metrics = {k: v / updates for k, v in totals.items()}
        metrics.update(
            samples=len(samples),
            optimizer_steps=updates,
            adv_abs_mean=_adv_abs_mean(plan.advantages, samples),
            train_s=time.perf_counter() - t0,
        )
        if isinstance(plan, GAEPlan):
            metrics.update(plan.stats)
        if self.spec.is_moe:
            counts = moe.take_mismatch(self.model)
            if self.sequence_parallel:  # each TP rank routed its share of the tokens
                counts = tuple(int(allreduce_sum(float(n), self.tp_group)) for n in counts)
            differing, compared = (self._dp_sum(float(n)) for n in counts)
            if compared:
                metrics["routing_mismatch"] = differing / compared
        return metrics

    def _ppo_critic(self) -> Critic:
        if self.critic is None:
            raise ValueError("the ppo loss trains a critic, which is built only when the configured loss is ppo")
        return self.critic

    def _update(self, samples: list[Sample], rows: list[tuple], cfg: LossSettings, single: bool) -> dict[str, float]:
        """One optimizer step over ``samples`` (gradient accumulation across micro-batches)."""
        mine, my_rows = self._dp_shard(samples, rows)
        if not mine:
            my_rows = []
        adv, masks, old = ([r[k] for r in my_rows] for k in range(3))
        has_old = bool(old) and old[0] is not None
        batches = self._micro_batches(mine, adv, masks, old if has_old else None)
        counted = self._dp_sum(sum(b.num_tokens for b in batches))  # global token count
        denom = float(max(counted, max((s.norm_tokens for s in samples), default=0), 1))
        seqs = float(max(self._dp_sum(sum(int((b.target_mask.sum(-1) > 0).sum()) for b in batches)), 1))
        self.optimizer.zero_grad(set_to_none=True)
        frozen = cfg.name == "ppo" and self.step < cfg.critic_warmup_steps  # the critic's warm-up: it learns alone
        bounded = self.settings.max_step_kl is not None and cfg.name != "sft" and not frozen
        before = (self._old_logprobs(mine), [p.detach().clone() for p in self.model.parameters()]) if bounded else None
        sums: dict[str, float] = {}
        for mb in [] if frozen else batches:
            with self._routes(mb):
                for k, v in self._micro_step(mb, cfg, denom, seqs, single).items():
                    sums[k] = sums.get(k, 0.0) + v
        clipped = cfg.replay_clip_fresh or any(s.replayed for s in samples)
        if clipped and cfg.replay_clip is not None:  # every DP rank sums the same keys
            for k in ("replay_tokens", "replay_clipped"):
                sums.setdefault(k, 0.0)
        metrics: dict[str, float] = {}
        if not frozen:
            self._dp_allreduce_grads()
            allreduce_tp_partial_grads(self.model, self.tp_group)
            sums = {k: self._dp_sum(sums[k]) for k in sorted(sums)}  # same order on every DP rank
            grad_norm = self.optimizer.clip_grad_norm_(self.settings.grad_clip)  # global norm under TP (and on GPU)
            self.optimizer.step()
            # the loss is averaged over ``denom`` (it may count left-out groups: Sample.norm_tokens); the per-token
            # diagnostics (nll, IS weights, log-prob gap, clip fractions) are means over the tokens measured
            own = float(max(counted, 1))
            metrics = {k: v / (denom if k == "loss" else own) for k, v in sums.items()}
            metrics["grad_norm"] = float(grad_norm)
            if before is not None:
                metrics.update(self._bound_step(mine, masks, *before))
        self.scheduler.step()
        metrics.update(lr=self.scheduler.get_last_lr()[0], tokens=denom, policy_frozen=float(frozen))
        metrics["micro_batches"] = float(len(batches))
        if cfg.name == "ppo":  # the critic's own step on the same rows (returns and old values ride along)
            metrics.update(self._ppo_critic().update(mine, my_rows, float(max(counted, 1)), cfg))
        return metrics

    def _bound_step(
        self, samples: list[Sample], masks: list[list[int]], before: list[list[float]], weights: list[torch.Tensor]
    ) -> dict[str, float]:
        """``max_step_kl``: halve the step just taken along its own direction until the batch's mean k3 estimate of
        KL(before || after) over the trained tokens is within the bound; after 5 halvings keep the weights of before.

        Every rank measures the same global KL (summed over DP ranks), so all take the same decision."""
        bound = float(self.settings.max_step_kl or 0.0)
        params = list(self.model.parameters())
        steps = [p.detach() - w for p, w in zip(params, weights, strict=True)]
        scale, kl = 1.0, self._step_kl(samples, masks, before)
        while kl > bound and scale > 1 / 32:
            scale /= 2
            kl = self._rescale_step(params, weights, steps, scale, samples, masks, before)
        if kl > bound:  # back to the weights of before: nothing moved, nothing to measure
            with torch.no_grad():
                for p, w in zip(params, weights, strict=True):
                    p.copy_(w)
            scale, kl = 0.0, 0.0
        return {"step_kl": kl, "step_scale": scale}

    @torch.no_grad()
    def _rescale_step(
        self,
        params: list[torch.Tensor],
        weights: list[torch.Tensor],
        steps: list[torch.Tensor],
        scale: float,
        samples: list[Sample],
        masks: list[list[int]],
        before: list[list[float]],
    ) -> float:
        for p, w, d in zip(params, weights, steps, strict=True):
            p.copy_(w + scale * d)
        return self._step_kl(samples, masks, before)

    def _step_kl(self, samples: list[Sample], masks: list[list[int]], before: list[list[float]]) -> float:
        """Mean k3 estimate of KL(before || now) over the masked tokens of ``samples`` (all DP ranks)."""
        now = self._old_logprobs(samples)
        total, count = 0.0, 0
        for a, b, m in zip(now, before, masks, strict=True):
            on = torch.tensor(m[1 : len(a)], dtype=torch.bool)
            log_r = (torch.tensor(a[1:], dtype=torch.float64) - torch.tensor(b[1:], dtype=torch.float64))[on]
            total += float((torch.exp(log_r) - 1 - log_r).sum())
            count += int(on.sum())
        return self._dp_sum(total) / max(self._dp_sum(float(count)), 1.0)

    def sample_logprobs(self, samples: list[Sample]) -> list[list[float]]:
        """The trainer's log-probs of every token of ``samples`` under the current weights (aligned with
        ``token_ids``; position 0 = 0), with the samples' routes replayed or compared as in training."""
        return self._old_logprobs(samples)

    @torch.no_grad()
    def _old_logprobs(self, samples: list[Sample]) -> list[list[float]]:
        """The trainer's log-probs of every token before the update (aligned with ``token_ids``; position 0 = 0)."""
        out: list[list[float]] = [[] for _ in samples]
        zeros = [0.0] * len(samples)
        for mb in self._micro_batches(samples, zeros):
            with self._routes(mb):
                logp = token_logprobs(
                    self.model, mb.input_ids, mb.attention_mask(), self.settings.temperature, mb.vocab_masks, mb.packing
                )
            for r, i in enumerate(mb.rows):
                out[i] = [0.0] + logp[r, : int(mb.lengths[r]) - 1].tolist()
        return out

    def _routes(self, mb: MicroBatch) -> contextlib.AbstractContextManager[None]:
        """The engine's expert choices for ``mb``'s tokens (MoE): replayed with ``routing_replay``, else only compared
        with the router's own (``train/routing_mismatch``)."""
        if mb.routes is None or not self.spec.is_moe:
            return contextlib.nullcontext()
        routes = moe.token_order(mb.routes, mb.packing, mb.lengths)
        return moe.replaying(self.model, routes, self.settings.routing_replay)

    def _micro_batches(
        self, samples: list[Sample], adv: list, masks: list | None = None, old: list | None = None
    ) -> list[MicroBatch]:
        """``make_micro_batches`` under this trainer's token budget, packed when :attr:`packing`."""
        budget = self.settings.micro_batch_tokens
        return make_micro_batches(samples, adv, budget, masks, old, packing=self.packing)

    # -- data parallelism (world size 1 here: identity; the parallel trainer group overrides these) -----------------
    def _dp_shard(self, samples: list[Sample], rows: list[Any]) -> tuple[list[Sample], list[Any]]:
        """This DP rank's share of the batch and of its per-sample ``rows`` (disjoint across ranks, token-balanced).

        A rank left without samples gets one zero-mask padding sample, so every rank runs the same collectives
        (``trainer.parallel.shard_for_dp``). The batch indices taken are kept in ``last_dp_shard``.
        """
        mine, my_rows, self.last_dp_shard = shard_for_dp(samples, rows, self.dp_rank, self.dp_size)
        return mine, my_rows

    def _dp_sum(self, value: float) -> float:
        """Sum of ``value`` over DP ranks (a collective when DP > 1: every rank must call it, in the same order)."""
        if self.dp_size == 1:
            return value
        return allreduce_sum(value, self.dp_group, device="cuda" if self.device == "cuda" else "cpu")

    def _dp_allreduce_grads(self) -> None:
        """Sum gradients over DP ranks (each rank's loss is already divided by the global token count).

        On CUDA: Megatron DDP's ``finish_grad_sync`` (always: it also readies the grad buffers at DP=1).
        """
        if self.device == "cuda":
            self.model.finish_grad_sync()
        elif self.dp_size > 1:
            allreduce_grads(self.model.parameters(), self.dp_group)

    def _micro_step(self, mb: MicroBatch, cfg: LossSettings, denom: float, seqs: float, single: bool) -> dict:
        if cfg.name == "sft":
            logp = token_logprobs(self.model, mb.input_ids, mb.attention_mask(), packing=mb.packing)
            value = sft_loss(logp, mb.target_mask, denom)
            value.backward()
            return {"loss": float(value.detach()) * denom}
        entropy = student_top = divergence = teacher = None
        topk = cfg.distill_loss_coef > 0 and cfg.distill_loss_estimator == "topk"
        full = cfg.distill_loss_coef > 0 and cfg.distill_loss_estimator in registry.FULL_VOCAB_ESTIMATORS
        if topk and (cfg.entropy_coef > 0 or self.settings.temperature != 1.0 or mb.teacher_top_ids is None):
            raise ValueError("the top-k distillation loss needs temperature 1, no entropy bonus and teacher top-k ids")
        if full:
            if self.settings.temperature != 1.0:
                raise ValueError("the full-vocabulary distillation loss compares distributions at temperature 1")
            terms = full_vocab_terms(
                self.model,
                teacher_groups(mb.teachers, self._teacher_models(cfg)),
                mb.input_ids,
                mb.lengths,
                registry.resolve("distill_loss_estimator", cfg.distill_loss_estimator),
                cfg.distill_jsd_beta,
                self.settings.distill_chunk_tokens,
                mb.vocab_masks,
                mb.packing,
                entropy=cfg.entropy_coef > 0,
            )
            logp, divergence, entropy, teacher = terms.logp, terms.divergence, terms.entropy, terms.teacher_logp
        elif topk:
            logp, student_top = token_logprobs_at(
                self.model, mb.input_ids, mb.teacher_top_ids, mb.attention_mask(), mb.vocab_masks, mb.packing
            )
        elif cfg.entropy_coef > 0:
            if self.settings.temperature != 1.0:
                raise ValueError("the entropy bonus is defined at temperature 1; set rollout.temperature=1")
            logp, entropy = token_logprobs_and_entropy(
                self.model, mb.input_ids, mb.attention_mask(), mb.vocab_masks, mb.packing
            )
        else:
            logp = token_logprobs(
                self.model, mb.input_ids, mb.attention_mask(), self.settings.temperature, mb.vocab_masks, mb.packing
            )
        if mb.old_logprobs is not None:
            old = mb.old_logprobs
        else:  # one update per batch: old == current (detached); several without recompute: the behaviour policy
            old = logp.detach() if single else mb.behaviour_logprobs
        x = LossInputs(logp, old, mb.behaviour_logprobs, mb.advantages, mb.target_mask, mb.ref_logprobs, entropy)
        x.teacher, x.teacher_top, x.student_top = mb.teacher_logprobs, mb.teacher_top_logprobs, student_top
        x.divergence, x.replayed = divergence, mb.replayed
        if x.teacher is None:  # the in-trainer teacher's own log-probs of the tokens (metrics)
            x.teacher = teacher
        value, metrics = policy_loss(x, cfg, denom, seqs)
        value.backward()
        out = {k: float(v) for k, v in metrics.items()}
        out["loss"] = float(value.detach()) * denom
        out["nll"] = float(-(logp.detach() * mb.target_mask).sum())
        return out

    def _teacher_models(self, cfg: LossSettings) -> dict[str, torch.nn.Module]:
        """The in-trainer teachers, loaded on first use."""
        if self.teachers is None:
            if not self.settings.teachers:
                raise ValueError(
                    f"distill_loss_estimator {cfg.distill_loss_estimator!r} compares full distributions with teacher "
                    "models the trainer loads itself: settings.teachers names none"
                )
            s = self.settings
            self.teachers = load_teachers(s.teachers, self.spec, s.seed, self.device, self._bf16, self._layer_spec)
        return self.teachers

    @torch.no_grad()
    def eval_nll(self, samples: list[Sample]) -> float:
        """Token-level mean negative log-likelihood of the model tokens (SFT validation loss)."""
        total, count = 0.0, 0
        for mb in self._micro_batches(samples, [0.0] * len(samples)):
            logp = token_logprobs(self.model, mb.input_ids, mb.attention_mask(), packing=mb.packing)
            total += float(-(logp * mb.target_mask).sum())
            count += mb.num_tokens
        return total / max(count, 1)

    @torch.no_grad()
    def sequence_logprobs(
        self, token_ids: list[int], temperature: float | None = None, vocab_masks: list[tuple[int, bytes]] = ()
    ) -> list[float]:
        """Per-token log-probs of one sequence (position t: token t+1), as the RL loss sees them (restricted where
        ``vocab_masks``, as in ``Sample.vocab_masks``, says)."""
        ids = torch.tensor([token_ids])
        t = self.settings.temperature if temperature is None else temperature
        masks = collate_vocab_masks([Sample(token_ids, [0] * len(token_ids), [0.0] * len(token_ids),
                                            vocab_masks=list(vocab_masks))])  # fmt: skip
        return token_logprobs(self.model, ids, temperature=t, vocab_masks=masks).squeeze(0).tolist()

    # -- weights out ---------------------------------------------------------------------------------------------
    def export_weights(self) -> dict[str, torch.Tensor]:
        return export_hf_state(self.model, self.spec)

    def export_buckets(self, bucket_bytes: int = 32 << 20) -> list[Bucket]:
        """The current version as checksummed buckets (TransferMesh's sending side)."""
        return pack_version(self.export_weights(), self.version, bucket_bytes)

    def save_hf(self, out_dir: str | Path) -> Path:
        return save_hf_dir(self.model, self.spec, self.model_dir, out_dir)

    # -- checkpoints ---------------------------------------------------------------------------------------------
    def save_checkpoint(self, path: str | Path, extra: dict[str, Any] | None = None) -> None:
        """Model, optimizer, scheduler, RNG states, step and version, plus caller's ``extra`` (trained ids)."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
            "step": self.step,
            "version": self.version,
            "extra": extra or {},
        }
        if self.critic is not None:
            state["critic"] = self.critic.state_dict()
        tmp = p.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)  # the leftover of a write a crash cut short
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            _fault_pause(p.name)
            os.fsync(f.fileno())
        tmp.replace(p)  # atomic: a crash never leaves a half-written checkpoint under the final name

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        state = torch.load(path, weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.critic is not None:
            if "critic" not in state:
                raise ValueError(f"checkpoint {path} holds no critic (it was not saved by a ppo run)")
            self.critic.load_state_dict(state["critic"])
        torch.set_rng_state(state["rng"]["torch"])
        np.random.set_state(state["rng"]["numpy"])
        random.setstate(state["rng"]["python"])
        self.step, self.version = state["step"], state["version"]
        return state["extra"]


def _fault_pause(name: str) -> None:
    """Fault injection for crash tests: ``AGENTFLOW_FAULT_CHECKPOINT_PAUSE=NAME:SECONDS`` holds the write of checkpoint
    ``NAME`` open (data written, not yet synced or renamed) so a test can SIGKILL the trainer in the middle of it."""
    spec = os.environ.get("AGENTFLOW_FAULT_CHECKPOINT_PAUSE", "")
    target, _, seconds = spec.partition(":")
    if target == name:
        time.sleep(float(seconds or 30))


def _split(n: int, parts: int) -> list[list[int]]:
    """Indices 0..n-1 in ``parts`` contiguous, near-equal chunks (empty chunks dropped)."""
    size = -(-n // parts)
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)]


def _adv_abs_mean(advantages: list[list[float]], samples: list[Sample]) -> float:
    """Mean |advantage| over the trained (loss-mask) tokens: per-token advantages (turn credit, a distillation
    reward) vary along a row, so a row's first entry (a prompt token's 0) says nothing."""
    total, n = 0.0, 0
    for row, s in zip(advantages, samples, strict=True):
        for a, m in zip(row, s.loss_mask, strict=True):
            if m:
                total, n = total + abs(a), n + 1
    return total / n if n else 0.0
