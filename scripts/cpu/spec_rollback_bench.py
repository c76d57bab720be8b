"""CPU: the two GDN rollbacks of speculative verification, "keep" (per-position state copies) and
"recompute" (one copy, then re-run the accepted tokens' recurrence), timed per engine step.

    python scripts/cpu/spec_rollback_bench.py --preset qwen3.5-0.8b --out FILE.json

One greedy request, k drafts per step from a script that knows the greedy tokens: "all" (every
draft right: no rollback, only the copies), "one" (the first right, the rest wrong: a rollback
every step). Plain decode steps of the same request for scale. Median step time over the steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from deltaserve.bench.record import device_info, git_commit  # noqa: E402
from deltaserve.cache.manager import CacheConfig  # noqa: E402
from deltaserve.engine.engine import Engine, EngineConfig  # noqa: E402
from deltaserve.engine.sampling import SamplingParams  # noqa: E402
from deltaserve.engine.scheduler import SchedulerConfig  # noqa: E402
from deltaserve.spec.config import SpeculativeConfig  # noqa: E402


def engine_for(llm, spec) -> Engine:
    cfg = EngineConfig(SchedulerConfig(max_num_seqs=2), CacheConfig(2, 64, 64, 64, 0),
                       speculative=spec)
    return Engine(llm.model, llm.tokenizer, llm.eos_token_ids, llm.max_model_len, cfg, "bench")


def step_times(engine, prompt: list[int], num_new: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and the wall time of each step after the prefill."""
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=num_new,
                                                   ignore_eos=True))
    tokens, times = [], []
    first = True
    while engine.has_work:
        t0 = time.perf_counter()
        out = engine.step()
        if not first:
            times.append(time.perf_counter() - t0)
        first = False
        for ev in out:
            tokens += ev.token_ids
    return tokens, times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3.5-0.8b")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--num-new", type=int, default=41)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from deltaserve import LLM
    from deltaserve.checkpoint.presets import preset
    from deltaserve.checkpoint.writer import write_checkpoint

    work = Path(tempfile.mkdtemp()) / args.preset
    write_checkpoint(preset(args.preset), work, seed=0)
    llm = LLM(work, dtype="bfloat16")
    prompt = list(range(100, 164))
    want, plain = step_times(engine_for(llm, None), prompt, args.num_new)
    rows = {"decode_step_ms": round(1e3 * statistics.median(plain), 2)}
    for strategy in ("keep", "recompute"):
        for case, num_right in (("all", args.k), ("one", 1)):
            engine = engine_for(llm, SpeculativeConfig(num_speculative_tokens=args.k,
                                                       adaptive=False, rollback=strategy))

            def propose(rid, num, engine=engine, num_right=num_right):
                g = len(engine.scheduler.get(rid).output_ids)
                return [t if j < num_right else (t + 1) % llm.config.vocab_size
                        for j, t in enumerate(want[g : g + num])]

            engine.spec._propose = propose
            got, times = step_times(engine, prompt, args.num_new)
            assert got == want, (strategy, case)
            rows[f"{strategy}/{case}"] = {"verify_step_ms": round(1e3 * statistics.median(times), 2),
                                          "steps": len(times),
                                          "tokens_per_step": round(len(got) / (len(times) + 1), 2)}
            print(strategy, case, rows[f"{strategy}/{case}"], flush=True)
    record = {"git_commit": git_commit(), "device": device_info("cpu"), "preset": args.preset,
              "dtype": "bfloat16", "k": args.k, "results": rows}
    print(json.dumps(record, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
