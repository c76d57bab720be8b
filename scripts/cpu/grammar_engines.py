"""xgrammar against llguidance on one tokenizer (issue 33's choice of grammar engine): tokenizer
set-up, JSON-schema compile time (first and cached) and the per-step mask time at batch 1 / 16 / 64,
each matcher walking its grammar by taking a random allowed token per step. One JSON record.

    pip install llguidance   # only for this comparison; deltaserve uses xgrammar
    python scripts/cpu/grammar_engines.py --model CHECKPOINT --out record.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from importlib.metadata import version
from pathlib import Path

import torch

SCHEMAS = [
    {"type": "object", "properties": {"ids": {"type": "array", "items": {
        "type": "integer", "minimum": 0, "maximum": 999}, "maxItems": 40},
        "tag": {"enum": ["alpha", "beta", "gamma"]}, "ok": {"type": "boolean"}},
     "required": ["ids", "tag", "ok"]},
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name"]},
    {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "number"},
                                                                 "y": {"type": "number"}}}},
]


def allowed_tokens(mask_row: torch.Tensor, vocab: int) -> list[int]:
    bits = ((mask_row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab]
    return bits.nonzero().flatten().tolist()


class XGrammar:
    def __init__(self, hf, vocab: int) -> None:
        import xgrammar as xgr

        self.xgr, self.vocab = xgr, vocab
        self.compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab))

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema))

    def matchers(self, compiled, n: int) -> list:
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def bitmask(self, n: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(n, self.vocab)

    def fill(self, matcher, mask, i: int) -> None:
        matcher.fill_next_token_bitmask(mask, i)

    def accept(self, matcher, token: int) -> None:
        if not matcher.accept_token(token) or matcher.is_terminated():
            matcher.reset()


class LLGuidance:
    def __init__(self, hf, vocab: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll, self.vocab = llguidance, vocab
        self.tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)

    def compile(self, schema: dict):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        self.ll.LLMatcher.validate_grammar(grammar, self.tokenizer)
        return grammar

    def matchers(self, compiled, n: int) -> list:
        return [self.ll.LLMatcher(self.tokenizer, compiled) for _ in range(n)]

    def bitmask(self, n: int) -> torch.Tensor:
        return self.ll.torch.allocate_token_bitmask(n, self.vocab)

    def fill(self, matcher, mask, i: int) -> None:
        self.ll.torch.fill_next_token_bitmask(matcher, mask, i)

    def accept(self, matcher, token: int) -> None:
        if not matcher.consume_token(token) or matcher.is_stopped() or matcher.is_error():
            matcher.reset()


def measure(engine, batches: list[int], steps: int) -> dict:
    out: dict = {"compile_first_ms": [], "compile_cached_ms": []}
    compiled = None
    for schema in SCHEMAS:
        for key in ("compile_first_ms", "compile_cached_ms"):
            start = time.perf_counter()
            result = engine.compile(schema)
            out[key].append(1e3 * (time.perf_counter() - start))
        compiled = compiled or result
    rng = random.Random(0)
    for batch in batches:
        matchers = engine.matchers(compiled, batch)
        mask = engine.bitmask(batch)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            for i, m in enumerate(matchers):
                engine.fill(m, mask, i)
            times.append(1e3 * (time.perf_counter() - start))
            for i, m in enumerate(matchers):
                engine.accept(m, rng.choice(allowed_tokens(mask[i], engine.vocab)))
        out[f"mask_b{batch}_ms"] = {"median": statistics.median(times), "max": max(times)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="a checkpoint folder (its tokenizer.json)")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from transformers import PreTrainedTokenizerFast

    from deltaserve.bench.record import device_info, git_commit

    hf = PreTrainedTokenizerFast(tokenizer_file=str(Path(args.model) / "tokenizer.json"))
    vocab = json.loads((Path(args.model) / "config.json").read_text()).get("vocab_size") or \
        json.loads((Path(args.model) / "config.json").read_text())["text_config"]["vocab_size"]
    record = {"commit": git_commit(), "device": device_info("cpu"), "vocab": vocab,
              "versions": {n: version(n) for n in ("xgrammar", "llguidance")}, "engines": {}}
    for name, cls in (("xgrammar", XGrammar), ("llguidance", LLGuidance)):
        start = time.perf_counter()
        engine = cls(hf, vocab)
        result = {"tokenizer_setup_s": time.perf_counter() - start}
        result.update(measure(engine, [int(b) for b in args.batches.split(",")], args.steps))
        record["engines"][name] = result
        print(name, json.dumps(result), flush=True)
    Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
