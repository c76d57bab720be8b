"""H200: where the time of a short prefill goes (the prefix-cache hit and the image prompt are one).

    python3 scripts/gpu/ttft_profile.py --out ttft_profile.json

For each case (a 40-token chunk behind a cached 4k prefix, fresh 40- and 89-token prompts): the
wall time of generate(max_tokens=1) (median of 5, no profiler), then one profiled call: GPU busy
time, the number of CPU-side ops and kernel launches, and the ops that cost the most host time.
Run it twice (DELTASERVE_FLA=0 for the second) to compare the prefill scans.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from deltaserve import LLM, SamplingParams  # noqa: E402
from deltaserve.checkpoint.presets import preset  # noqa: E402
from deltaserve.checkpoint.writer import write_checkpoint  # noqa: E402


def _profiled(llm: LLM, ids: list[int], one: SamplingParams, stacks: bool = False) -> dict:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 with_stack=stacks) as prof:
        llm.generate([ids], one)
    events = prof.key_averages()
    by_line = _launch_sites(prof) if stacks else None
    cuda_us = sum(e.self_device_time_total for e in events)
    launches = sum(e.count for e in events if "LaunchKernel" in e.key or "cuLaunch" in e.key)
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:25]
    return {
        "gpu_busy_ms": cuda_us / 1e3,
        "cpu_ops": sum(e.count for e in events if e.key.startswith("aten::")),
        "launches": launches,
        "top_self_cpu": [{"op": e.key[:80], "count": e.count,
                          "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3)} for e in top],
        **({"launch_sites": by_line} if by_line else {}),
    }


def _launch_sites(prof) -> list[dict]:
    """Host work per deltaserve call site (the innermost two deltaserve frames above it):
    top-level aten ops (each one dispatch, most one launch) and Triton kernel launches."""
    counts: dict[str, list] = {}
    for e in prof.events():
        parent = e.cpu_parent
        top_aten = e.name.startswith("aten::") and not (parent and parent.name.startswith("aten::"))
        triton_run = "triton/runtime/jit.py" in e.name and e.name.endswith(": run")
        if not (top_aten or triton_run):
            continue
        frames, node = [], parent
        while node is not None and len(frames) < 2:
            if "deltaserve/" in node.name:
                frames.append(node.name.split("deltaserve/")[-1])
            node = node.cpu_parent
        site = " < ".join(frames) or "(no deltaserve frame)"
        row = counts.setdefault(site, [0, 0.0, set()])
        row[0] += 1
        row[1] += e.cpu_time_total / 1e3
        row[2].add("triton" if triton_run else e.name)
    rows = sorted(counts.items(), key=lambda kv: kv[1][1], reverse=True)
    return [{"site": k, "count": v[0], "cpu_ms": round(v[1], 3), "kinds": sorted(v[2])[:6]}
            for k, v in rows[:60]]


def _wall(llm: LLM, make_ids, one: SamplingParams, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        ids = make_ids()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate([ids], one)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="ttft_profile.json")
    ap.add_argument("--cprofile", action="store_true",
                    help="also print the Python functions that cost the most host time")
    ap.add_argument("--stacks", action="store_true",
                    help="count kernel launches and copies per deltaserve source line")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp()) / "q08"
    write_checkpoint(preset("qwen3.5-0.8b"), work, seed=0)
    llm = LLM(work, dtype="bfloat16", device="cuda")
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    g = torch.Generator().manual_seed(0)

    def rand(n: int) -> list[int]:
        return torch.randint(0, 240000, (n,), generator=g).tolist()

    system = rand(4096)
    llm.generate([system + [1, 2, 3]], one)  # the prefix lands in the cache
    for n in (40, 89):
        llm.generate([rand(n)], one)  # first-use costs (compiles) out of the way
    cases = {"hit_4k_plus_40": lambda: system + rand(40), "fresh_40": lambda: rand(40),
             "fresh_89": lambda: rand(89), "fresh_4096": lambda: rand(4096)}
    record = {"fla": os.environ.get("DELTASERVE_FLA", "1"), "cases": {}}
    for name, make in cases.items():
        wall = _wall(llm, make, one)
        prof = _profiled(llm, make(), one, stacks=args.stacks and name != "fresh_4096")
        record["cases"][name] = {"wall_ms": round(wall, 2), **prof}
        print(name, f"wall {wall:.1f} ms, gpu busy {prof['gpu_busy_ms']:.1f} ms, "
              f"{prof['cpu_ops']} aten ops, {prof['launches']} launches", flush=True)
        for row in prof["top_self_cpu"][:8]:
            print("   ", row, flush=True)
        for row in prof.get("launch_sites", [])[:40]:
            print("    site", row["count"], row["cpu_ms"], row["site"], row["kinds"], flush=True)
    Path(args.out).write_text(json.dumps(record, indent=1))
    if args.cprofile:
        for name in ("fresh_40", "hit_4k_plus_40", "fresh_4096"):
            _python_profile(llm, cases[name](), one, name)


def _python_profile(llm: LLM, ids: list[int], one: SamplingParams, name: str) -> None:
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    llm.generate([ids], one)
    torch.cuda.synchronize()
    prof.disable()
    print(f"--- cProfile {name}: tottime, then cumulative", flush=True)
    stats = pstats.Stats(prof).strip_dirs()
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(45)


if __name__ == "__main__":
    main()
