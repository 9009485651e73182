"""Make a small Qwen2- or Qwen3-architecture Hugging Face model directory locally, deterministically from a seed.

The tokenizer is a byte-level BPE trained here with the ``tokenizers`` library on a synthetic corpus (chat markup,
tool-call JSON, arithmetic and plain English), with digits split one per token so numbers can be copied digit by
digit. Weights are random (normal, std 0.02). Nothing is downloaded.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from agentflow.chat import CHAT_TEMPLATE, EOS, IM_END, SPECIAL_TOKENS, ToolCall, render_conversation


@dataclass
class ModelInitConfig:
    """Shape of the model to create."""

    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 688
    vocab_size: int = 1024
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    seed: int = 0
    arch: str = "qwen2"
    """``qwen2`` (q/k/v biases), ``qwen3`` (no biases; per-head q/k RMSNorm) or ``qwen3_moe`` (qwen3 with routed
    experts in place of every MLP)."""
    num_experts: int = 8
    """Experts per layer (``qwen3_moe``)."""
    num_experts_per_tok: int = 2
    """Experts each token is routed to (``qwen3_moe``)."""
    moe_intermediate_size: int = 344
    """Each expert's MLP width (``qwen3_moe``; top-2 of 344 is as wide as the dense default's 688)."""

    def __post_init__(self) -> None:
        if self.arch not in ARCHES:
            raise ValueError(f"unknown arch {self.arch!r}; choose from {list(ARCHES)}")


ARCHES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")


_WORDS = (
    "the a an of to and in is are what which who how many much value result answer question number sum product "
    "difference remainder compute evaluate expression tool call function arguments name description parameters "
    "type object string integer required properties you helpful assistant use tools think step first then final "
    "error invalid unknown please try again with when if not only one two three four five six seven eight nine ten"
).split()


def env_corpus(env_ids: list[str], episodes: int = 200) -> list[str]:
    """Text of registered environments (system prompt with tools, first observations) for the tokenizer.

    Merges learned from it make the job's own prompts short, which is what makes training on 2 cores affordable.
    An env whose later observations look unlike its first one may offer ``tokenizer_texts() -> list[str]`` (text of
    the current task it will show, called after each reset); it joins the corpus too. No env ids: no text, and the
    env registry (with Gymnasium) is not imported.
    """
    if not env_ids:
        return []
    import envs

    texts = []
    for env_id in env_ids:
        env = envs.make(env_id)
        tools = [t.to_openai() for t in env.tools]
        try:
            extra = getattr(env.unwrapped, "tokenizer_texts", None)
            for seed in range(episodes):
                obs, _ = env.reset(seed=seed)
                msgs = [{"role": "system", "content": env.system_prompt}, {"role": "user", "content": obs}]
                texts.append(render_conversation(msgs, tools, add_generation_prompt=True))
                if extra is not None:  # what the env will show later in the episode (tool outputs, files)
                    texts.extend(extra())
        finally:
            env.close()
    return texts


def _corpus(seed: int, n: int = 3000) -> list[str]:
    """Synthetic training text for the tokenizer: markup, tool JSON, arithmetic, words."""
    rng = random.Random(seed)
    tool = {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate an arithmetic expression",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
    texts = []
    for _ in range(n):
        a, b = rng.randint(0, 9999), rng.randint(1, 999)
        op = rng.choice(["+", "-", "*", "%"])
        q = f"What is {a} {op} {b}?"
        call = ToolCall("calc", {"expression": f"{a} {op} {b}"})
        msgs = [
            {"role": "system", "content": "You are a helpful assistant. Use tools."},
            {"role": "user", "content": q},
            {"role": "assistant", "content": "", "tool_calls": [_as_openai(call)]},
            {"role": "tool", "content": str(rng.randint(-9999, 99999))},
            {"role": "assistant", "content": str(rng.randint(-9999, 99999))},
        ]
        texts.append(render_conversation(msgs, [tool]))
        texts.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 20))))
    return texts


def _as_openai(call: ToolCall) -> dict:
    return {"type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def train_tokenizer(vocab_size: int, seed: int, extra_texts: list[str] | None = None):
    """Train a byte-level BPE tokenizer with our special tokens and one token per digit."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        max_token_length=24,  # long enough to swallow JSON boilerplate, short enough to stay reusable
    )
    tok.train_from_iterator(_corpus(seed) + list(extra_texts or []), trainer=trainer)
    return tok


def _init_weights(cfg: ModelInitConfig) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(cfg.seed)
    h, kv_dim = cfg.hidden_size, cfg.hidden_size // cfg.num_attention_heads * cfg.num_key_value_heads

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    state = {"model.embed_tokens.weight": normal(cfg.vocab_size, h), "model.norm.weight": torch.ones(h)}
    head_dim = h // cfg.num_attention_heads
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        state |= {
            p + "self_attn.q_proj.weight": normal(h, h),
            p + "self_attn.q_proj.bias": torch.zeros(h),
            p + "self_attn.k_proj.weight": normal(kv_dim, h),
            p + "self_attn.k_proj.bias": torch.zeros(kv_dim),
            p + "self_attn.v_proj.weight": normal(kv_dim, h),
            p + "self_attn.v_proj.bias": torch.zeros(kv_dim),
            p + "self_attn.o_proj.weight": normal(h, h),
            p + "mlp.gate_proj.weight": normal(cfg.intermediate_size, h),
            p + "mlp.up_proj.weight": normal(cfg.intermediate_size, h),
            p + "mlp.down_proj.weight": normal(h, cfg.intermediate_size),
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
        }
        if cfg.arch != "qwen2":  # the same random draws as qwen2; no biases, and the per-head q/k norms
            for x in "qkv":
                del state[p + f"self_attn.{x}_proj.bias"]
            state[p + "self_attn.q_norm.weight"] = torch.ones(head_dim)
            state[p + "self_attn.k_norm.weight"] = torch.ones(head_dim)
        if cfg.arch == "qwen3_moe":  # a router and experts in place of the dense MLP
            for x in ("gate_proj", "up_proj", "down_proj"):
                del state[p + f"mlp.{x}.weight"]
            state[p + "mlp.gate.weight"] = normal(cfg.num_experts, h)
            m = cfg.moe_intermediate_size
            for j in range(cfg.num_experts):
                e = f"{p}mlp.experts.{j}."
                state |= {e + "gate_proj.weight": normal(m, h), e + "up_proj.weight": normal(m, h),
                          e + "down_proj.weight": normal(h, m)}  # fmt: skip
    if not cfg.tie_word_embeddings:
        state["lm_head.weight"] = normal(cfg.vocab_size, h)
    return state


def hf_config(cfg: ModelInitConfig, eos_id: int, bos_id: int) -> dict:
    fields = asdict(cfg)
    fields.pop("seed")
    arch = fields.pop("arch")
    moe = {k: fields.pop(k) for k in _MOE_FIELDS}
    extra: dict[str, object] = {}
    if arch != "qwen2":
        extra = {"head_dim": cfg.hidden_size // cfg.num_attention_heads, "attention_bias": False}
    if arch == "qwen3_moe":
        extra |= {**moe, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}
    return {
        "architectures": [ARCHES[arch]],
        "model_type": arch,
        **extra,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "use_sliding_window": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        **fields,
    }


def init_model(out_dir: str | Path, cfg: ModelInitConfig | None = None, env_ids: list[str] | None = None) -> Path:
    """Write config.json, model.safetensors, tokenizer.json and tokenizer_config.json into ``out_dir``.

    ``env_ids``: registered environments whose text joins the tokenizer's training corpus.
    """
    cfg = cfg or ModelInitConfig()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(cfg.vocab_size, cfg.seed, env_corpus(env_ids or []))
    if tok.get_vocab_size() > cfg.vocab_size:
        raise ValueError(f"tokenizer has {tok.get_vocab_size()} tokens > vocab_size {cfg.vocab_size}")
    tok.save(str(out / "tokenizer.json"))
    eos_id, im_end_id = tok.token_to_id(EOS), tok.token_to_id(IM_END)
    (out / "config.json").write_text(json.dumps(hf_config(cfg, im_end_id, eos_id), indent=2))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
        "eos_token": IM_END,
        "pad_token": EOS,
        "bos_token": None,
        "model_max_length": cfg.max_position_embeddings,
        "additional_special_tokens": SPECIAL_TOKENS[1:],
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end_id, eos_id]}))
    save_file(_init_weights(cfg), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def count_parameters(cfg: ModelInitConfig) -> int:
    return sum(t.numel() for t in _init_weights(cfg).values())
