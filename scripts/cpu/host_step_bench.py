"""Host time per engine step with the model taken out: what a GPU step pays in Python around its
graph replay (scheduler, sampler bookkeeping, stop checks, detokenizer, LLM loop).

    python scripts/cpu/host_step_bench.py [--batches 1,32,128] [--steps 64]

The runner's execute is replaced by one returning logits [rows, 64] (every request greedy, so the
sampler takes one argmax); the engine, scheduler and cache manager are the real ones (tiny model
config). Prints µs per step and per request-step, and the top functions by cProfile tottime.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from deltaserve import LLM, SamplingParams  # noqa: E402
from deltaserve.checkpoint.presets import preset  # noqa: E402
from deltaserve.checkpoint.writer import write_checkpoint  # noqa: E402
from deltaserve.engine.step import step_logits  # noqa: E402


def fake_execute(plan, all_ids, *_, **__):
    logits = torch.zeros(len(plan.chunks), 64)
    logits[:, 7] = 1.0  # token 7 every step (EOS ignored)
    return step_logits(logits, plan)


def run(llm: LLM, batch: int, steps: int, profile: bool) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    engine = llm.engine
    engine.runner.execute = fake_execute
    for i in range(batch):
        engine.add_request(f"r{i}", [5, 6, 7, 8], params)
    engine.step()  # the prefill step
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    for _ in range(steps):
        engine.step()
    if prof:
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    model = Path(tempfile.mkdtemp()) / "tiny"
    write_checkpoint(preset("tiny"), model, seed=0)
    for batch in [int(b) for b in args.batches.split(",")]:
        llm = LLM(model, dtype="float32", max_num_seqs=max(batch, 1), prefix_cache_bytes=0)
        per_step = run(llm, batch, args.steps, args.profile)
        print(f"batch {batch:4d}: {per_step * 1e6:8.1f} us per step, "
              f"{per_step * 1e6 / batch:6.1f} us per request-step", flush=True)


if __name__ == "__main__":
    main()
