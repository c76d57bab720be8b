"""Speculative decoding benchmark: greedy tok/s with and without drafts on natural prose, code and a
deliberately repetitive prompt, with the quality gate (tokens identical to the run without).

    python -m deltaserve.bench.spec [--model DIR] [--device cpu] [--methods ngram,mtp] \
        [--num-speculative-tokens 4] [--max-tokens 128] [--batch 1,4] --out FILE.json

Each workload's prompts run one at a time (batch 1) and all together (batch = their number), in
one process on one loaded model; every configuration runs after a warm-up. The repetitive prompt
measures the ceiling (drafts nearly always right), never the headline.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from deltaserve.bench.record import device_info, git_commit

# prose and code from the quality gate's fixed set; the ceiling prompt repeats a short block
GATE_IDS = {"prose": ("prose-short", "engineering-short", "finance-short"),
            "code": ("code-textwrap", "code-fractions")}
REPEAT_BLOCK = "for i in range(10):\n    total += values[i] * weights[i]\n"


def workloads(max_prompt_chars: int = 1500) -> dict[str, list[str]]:
    """prose, code (the gate prompts' openings) and repetitive (one block eight times)."""
    gate = json.loads((Path(__file__).parent / "gate_prompts.json").read_text())["prompts"]
    by_id = {p["id"]: p["text"][:max_prompt_chars] for p in gate}
    out = {name: [by_id[i] for i in ids] for name, ids in GATE_IDS.items()}
    out["repetitive"] = [REPEAT_BLOCK * 8]
    return out


def _engine(llm, spec):
    """An engine with or without drafts; the chunk budget resolved once, not from each engine's
    free memory (compared engines must differ only in speculation)."""
    from dataclasses import replace

    from deltaserve.engine.llm import DEFAULT_BATCHED_TOKENS, build_engine

    budget = llm.engine_args.max_num_batched_tokens
    if budget is None:
        budget = DEFAULT_BATCHED_TOKENS[llm.model.device.type == "cuda"]
    return build_engine(llm, replace(llm.engine_args, speculative_config=spec,
                                     max_num_batched_tokens=budget))


def _run(engine, prompts: list[list[int]], max_tokens: int,
         temperature: float = 0.0) -> tuple[list[list[int]], float]:
    """All prompts at once through the engine: (tokens per prompt, wall seconds). temperature > 0:
    sampled without a seed (seeded requests never draft)."""
    from deltaserve.engine.sampling import SamplingParams

    tokens = {f"p{i}": [] for i in range(len(prompts))}
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(f"p{i}", ids, params)
    while engine.has_work:
        for ev in engine.step():
            tokens[ev.request_id].extend(ev.token_ids)
    return [tokens[f"p{i}"] for i in range(len(prompts))], time.perf_counter() - t0


def measure(llm, spec, prompts: list[list[int]], max_tokens: int, batch: int,
            repeats: int, temperature: float = 0.0) -> dict:
    """One configuration on one workload: tokens, tok/s (best of `repeats`: other load on the
    machine only ever slows a run) and the speculative counters (of one run)."""
    from deltaserve.spec.verify import SpecStats

    engine = _engine(llm, spec)
    _run(engine, prompts[:1], 8)  # warm-up (native kernels, allocator)
    groups = [prompts] if batch > 1 else [[p] for p in prompts]
    best = float("inf")
    for _ in range(repeats):
        if engine.spec is not None:
            engine.spec.stats = SpecStats(accepted_per_pos=[0] * spec.num_speculative_tokens)
        outputs, seconds, steps0 = [], 0.0, engine.num_steps
        for group in groups:
            toks, dt = _run(engine, group, max_tokens, temperature)
            outputs += toks
            seconds += dt
        best = min(best, seconds)
    generated = sum(len(t) for t in outputs)
    row = {"generated_tokens": generated, "seconds": round(best, 3),
           "tok_s": round(generated / best, 2), "steps": engine.num_steps - steps0}
    if engine.spec is not None:
        row["speculative"] = engine.spec.stats.as_dict()
    return row, outputs


def run(llm, methods: list[str], num_tokens: int, max_tokens: int, batches: list[int],
        repeats: int = 3, temperature: float = 0.0) -> dict:
    from deltaserve.spec.config import SpeculativeConfig

    results = {}
    for name, texts in workloads().items():
        prompts = [llm.tokenizer.encode(t) for t in texts]
        for batch in batches:
            if batch > 1 and len(prompts) == 1:
                continue
            key = f"{name}/batch{batch if batch == 1 else len(prompts)}"
            base, want = measure(llm, None, prompts, max_tokens, batch, repeats, temperature)
            entry = {"num_prompts": len(prompts), "prompt_tokens": [len(p) for p in prompts],
                     "off": base}
            for method in methods:
                for adaptive in (False, True):
                    spec = SpeculativeConfig(method=method, num_speculative_tokens=num_tokens,
                                             adaptive=adaptive)
                    row, got = measure(llm, spec, prompts, max_tokens, batch, repeats,
                                       temperature)
                    if temperature == 0:
                        same = sum(a == b for a, b in zip(got, want, strict=True))
                        row["gate"] = {"tokens_identical": f"{same}/{len(want)}",
                                       "passed": same == len(want)}
                    else:  # another random stream: exactness is a distribution property
                        row["gate"] = {"sampled": True, "exactness": "tests/spec/test_sampled.py"}
                    row["net_gain"] = round(row["tok_s"] / base["tok_s"], 3)
                    entry[f"{method}{'-adaptive' if adaptive else ''}"] = row
                    print(key, method, "adaptive" if adaptive else "", json.dumps(row),
                          flush=True)
            results[key] = entry
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deltaserve.bench.spec", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: the embedded model)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--methods", default="ngram,mtp")
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", default="1,4", help="1: each prompt alone; >1: all at once")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (best)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="> 0: sampled requests (exact speculative sampling), unseeded")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from deltaserve import LLM

    llm = LLM(args.model, dtype=args.dtype, device=args.device)
    methods = [m for m in args.methods.split(",") if m]
    record = {"git_commit": git_commit(), "device": device_info(args.device),
              "model": str(llm.model_dir), "dtype": args.dtype,
              "flags": {"methods": methods, "num_speculative_tokens": args.num_speculative_tokens,
                        "max_tokens": args.max_tokens, "batch": args.batch, "eos": "ignored",
                        "repeats": args.repeats, "timing": "best of repeats",
                        "greedy": args.temperature == 0, "temperature": args.temperature},
              "note": "repetitive = the ceiling (drafts nearly always right), not the headline",
              "results": run(llm, methods, args.num_speculative_tokens, args.max_tokens,
                             [int(b) for b in args.batch.split(",")], args.repeats,
                             args.temperature)}
    text = json.dumps(record, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
