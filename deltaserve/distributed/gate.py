"""The quality gate of compressed reductions: one tensor-parallel model, its reductions exact (B)
against compressed (A), on the gate's prompts (bench/gate.py: agreement, JS divergence,
non-finite logits, collapse), plus the transport's overflow and non-finite counters. Every rank
calls it (the forwards are collective); all get the same record."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from deltaserve.distributed.comm import Compression


class _Mode:
    """An LLM seen with one reduction setting: the gate's functions read .tokenizer, .model and
    call .generate; each access sets the model's compression first."""

    def __init__(self, llm, compression: Compression) -> None:
        self._llm, self._compression = llm, compression

    def _set(self):
        self._llm.model.tp.comm.compression = self._compression
        return self._llm

    @property
    def tokenizer(self):
        return self._llm.tokenizer

    @property
    def model(self):
        return self._set().model

    def generate(self, *args, **kwargs):
        return self._set().generate(*args, **kwargs)


def compression_gate(llm, compression: Compression, thresholds: str = "quantized",
                     prompts_path: Path | None = None, max_prompts: int | None = None) -> dict:
    """Gate record of `compression` against exact reductions on llm (built with
    prefix_cache_bytes=0: a snapshot from one mode must not seed the other)."""
    from deltaserve.bench import gate

    if llm.tp is None:
        raise ValueError("compression_gate needs a tensor-parallel LLM")
    if llm.engine.cache.prefix is not None:
        raise ValueError("compression_gate needs LLM(prefix_cache_bytes=0)")
    th = gate.thresholds_from(thresholds)
    prompts = gate.load_json(prompts_path or gate.HERE / "gate_prompts.json", "gate prompts")
    prompts = prompts["prompts"][:max_prompts]
    comm = llm.model.tp.comm
    before = comm.compression
    exact = dataclasses.replace(compression, transport=None)
    comm.reset()
    try:
        rows = [gate.gate_prompt(_Mode(llm, compression), _Mode(llm, exact), p) for p in prompts]
        comm.compression = compression  # the report says which classes were compressed
        counters = comm.report()
    finally:
        comm.compression = before
    fails = gate.verdict(rows, th)
    return {
        "kind": "tp-compression-gate", "compression": dataclasses.asdict(compression),
        "ranks": llm.tp.world_size, "thresholds": th, "passed": not fails, "failures": fails,
        "counters": counters,
        "summary": {"mean_agreement": sum(r["agreement"] for r in rows) / len(rows),
                    "js_max": max(r["js_max"] for r in rows),
                    "js_mean": sum(r["js_mean"] for r in rows) / len(rows),
                    "nonfinite": sum(r["nonfinite"] for r in rows)},
        "prompts": [{k: v for k, v in r.items() if not k.startswith("text")} for r in rows],
    }
