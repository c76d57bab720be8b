"""`deltaserve needle`: retrieval rate over context lengths x depths x fresh keys, as a JSON record."""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from deltaserve.bench import needle
from deltaserve.bench.record import checkpoint_fingerprint, device_info, flags, git_commit
from deltaserve.errors import ConfigError
from deltaserve.progress import bar

MAX_ANSWER_TOKENS = 10


def _floats(text: str, what: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise ConfigError(f"--{what} takes comma-separated numbers, got {text!r}") from exc


def run_needle(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from deltaserve import LLM, EngineArgs, SamplingParams
    from deltaserve.checkpoint.default import default_model_dir
    from deltaserve.checkpoint.hub import resolve_model_dir

    model_dir = default_model_dir() if args.model is None else resolve_model_dir(args.model)
    lengths = [int(x) for x in _floats(args.lengths, "lengths")]
    depths = _floats(args.depths, "depths")
    if any(not 0.0 <= d <= 1.0 for d in depths):
        raise ConfigError(f"needle depth must be in [0, 1], got {args.depths}")
    if args.keys < 1:
        raise ConfigError(f"--keys must be at least 1, got {args.keys}")
    # filler: held-out stdlib lines named by the model's own manifest, else the default model's
    manifest = model_dir / "manifest.json"
    filler = needle.heldout_filler(
        manifest if manifest.exists() else default_model_dir() / "manifest.json"
    )
    llm = LLM.from_engine_args(replace(EngineArgs.from_cli_args(args), model=model_dir,
                                       mmproj=None))
    params = SamplingParams(temperature=0, max_tokens=MAX_ANSWER_TOKENS, ignore_eos=True)
    cells, t0 = [], time.perf_counter()
    shown = bar(len(lengths) * len(depths) * args.keys, "needle", "probe")
    for context_len in lengths:
        for depth in depths:
            hits = 0
            for k in range(args.keys):
                key = needle.make_key(random.Random(f"{context_len}/{depth}/{k}"))
                p = needle.build_prompt(llm.tokenizer.encode, filler, context_len, depth, key)
                out = llm.generate({"prompt_token_ids": p.ids}, params)[0].outputs[0]
                hits += needle.extract_answer(out.text) == key
                shown.update(1)
            cells.append({"context_len": context_len, "depth": depth, "hits": hits,
                          "num_keys": args.keys})
            shown.write(f"needle: {context_len:>6} tokens, depth {depth:.2f}: "
                        f"{hits}/{args.keys}", file=sys.stderr)
    shown.close()
    total = sum(c["hits"] for c in cells)
    record = {
        "kind": "needle", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git_commit": git_commit(),
        "model_dir": str(model_dir), "checkpoint_fingerprint": checkpoint_fingerprint(model_dir),
        "device": device_info(args.device), "dtype": args.dtype, "flags": flags(),
        "cells": cells, "retrieved": total, "num_prompts": len(cells) * args.keys,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    text = json.dumps(record, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0 if total == record["num_prompts"] else 2
