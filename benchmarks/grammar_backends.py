"""llguidance against xgrammar, the two structured-generation libraries we could build constrained decoding on.

Same tokenizer (the demo model's), same JSON schemas (a tool call's arguments), same token path (the canonical
tokens of one valid reply, fed to both matchers): per library the compile time, and the time to compute the
next-token bitmask and advance the matcher, per token. Medians over repeats. xgrammar is not one of our
dependencies: run this with an interpreter that has both, e.g. the SGLang test venv (scripts/sglang_test_venv.sh):

    .venv-sglang/bin/python benchmarks/grammar_backends.py [--model runs/models/demo-init]

Writes ``benchmarks/results/grammar_backends.json`` and ``.png`` (``.venv/bin/python benchmarks/grammar_backends.py
--plot`` draws the PNG where the measuring interpreter has no matplotlib).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parents[1]

SCHEMAS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "flat": (
        {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
         "required": ["city", "unit"], "additionalProperties": False},
        {"city": "Paris", "unit": "c"},
    ),
    "nested": (
        {"type": "object", "properties": {
            "people": {"type": "integer", "minimum": 1, "maximum": 12},
            "tags": {"type": "array", "items": {"type": "string", "enum": ["quiet", "window", "late"]}},
            "when": {"type": "object", "properties": {"day": {"type": "string"}, "hour": {"type": "integer"}},
                     "required": ["day", "hour"], "additionalProperties": False},
            "note": {"type": "string"}},
         "required": ["people", "tags", "when", "note"], "additionalProperties": False},
        {"people": 4, "tags": ["quiet", "window"], "when": {"day": "Friday", "hour": 20},
         "note": "A table by the window, please, for a birthday dinner."},
    ),
}  # fmt: skip


def _timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run_llguidance(tok_json: str, vocab: int, schema: dict[str, Any], ids: list[int]) -> dict[str, float]:
    import torch
    from llguidance import LLMatcher, LLTokenizer

    tokenizer = LLTokenizer(tok_json, n_vocab=vocab)
    style = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
    grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=style)
    compile_s = _timed(lambda: LLMatcher(tokenizer, grammar, log_level=0))
    mask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
    per_token = []
    for _ in range(20):
        m = LLMatcher(tokenizer, grammar, log_level=0)
        for t in ids:
            start = time.perf_counter()
            m.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
            assert m.consume_token(t), m.get_error()
            per_token.append(time.perf_counter() - start)
    return {"compile_ms": compile_s * 1e3, "mask_and_advance_us": statistics.median(per_token) * 1e6,
            "mask_and_advance_mean_us": statistics.mean(per_token) * 1e6}  # fmt: skip


def run_xgrammar(model_dir: Path, vocab: int, schema: dict[str, Any], ids: list[int]) -> dict[str, float]:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    compiled: list[Any] = []

    def compile_once() -> None:  # a fresh compiler each time: xgrammar caches compiled grammars per compiler
        compiled.append(xgr.GrammarCompiler(info).compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(", ", ": ")))  # fmt: skip

    compile_s = _timed(compile_once)
    mask = xgr.allocate_token_bitmask(1, vocab)
    per_token = []
    for _ in range(20):
        m = xgr.GrammarMatcher(compiled[0])
        for t in ids:
            start = time.perf_counter()
            m.fill_next_token_bitmask(mask)
            assert m.accept_token(t)
            per_token.append(time.perf_counter() - start)
    return {"compile_ms": compile_s * 1e3, "mask_and_advance_us": statistics.median(per_token) * 1e6,
            "mask_and_advance_mean_us": statistics.mean(per_token) * 1e6}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "runs" / "models" / "demo-init"))
    ap.add_argument("--out", default=str(RESULTS / "grammar_backends.json"))
    ap.add_argument("--plot", action="store_true", help="only draw the PNG from the JSON (needs matplotlib)")
    args = ap.parse_args()
    out = Path(args.out)
    if args.plot:
        return plot(json.loads(out.read_text()), out.with_suffix(".png"))
    from importlib.metadata import version

    from tokenizers import Tokenizer

    model_dir = Path(args.model)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    result: dict[str, Any] = {"model": model_dir.name, "vocab": vocab, "schemas": {}}
    result["versions"] = {"llguidance": version("llguidance"), "xgrammar": version("xgrammar")}
    for name, (schema, value) in SCHEMAS.items():
        ids = tok.encode(json.dumps(value), add_special_tokens=False).ids
        result["schemas"][name] = {
            "tokens": len(ids),
            "llguidance": run_llguidance(tok.to_str(), vocab, schema, ids),
            "xgrammar": run_xgrammar(model_dir, vocab, schema, ids),
        }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["schemas"], indent=1))
    try:
        plot(result, out.with_suffix(".png"))
    except ImportError:  # the SGLang venv has no matplotlib
        print(f"no matplotlib here: draw the PNG with .venv/bin/python {Path(__file__).name} --plot")


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = list(result["schemas"])
    for k, lib in enumerate(("llguidance", "xgrammar")):
        xs = [i + 0.4 * k for i in range(len(names))]
        a.bar(xs, [result["schemas"][n][lib]["mask_and_advance_us"] for n in names], width=0.4, label=lib)
        b.bar(xs, [result["schemas"][n][lib]["compile_ms"] for n in names], width=0.4, label=lib)
    for ax, label in ((a, "mask + advance per token (us, median)"), (b, "compile (ms)")):
        ax.set_xticks([i + 0.2 for i in range(len(names))], names)
        ax.set(ylabel=label, title=f"{result['model']} tokenizer, vocab {result['vocab']}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
