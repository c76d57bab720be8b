"""H200: where a prefill waits for the GPU, and where its host time goes; writes JSON.

    python3 scripts/gpu/prefill_syncs.py --out $OUT/prefill_syncs.json

For an 8k-token prompt (prefix cache off, as `bench` runs it) and a 40-token one: wall time
(median of 3, after a warm-up), every synchronizing CUDA call torch reports under
torch.cuda.set_sync_debug_mode("warn") counted per source line, and the Python functions with the
most host time (cProfile). A sync inside the layer loop drains the GPU's queue, after which the GPU
idles until the host has launched the next kernels: host and GPU time then add up instead of
overlapping.
"""

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from deltaserve import LLM, SamplingParams  # noqa: E402
from deltaserve.bench.record import git_commit  # noqa: E402
from deltaserve.checkpoint.presets import preset  # noqa: E402
from deltaserve.checkpoint.writer import write_checkpoint  # noqa: E402


def _case(llm: LLM, n: int, seed: int) -> dict:
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 240000, (n,), generator=g).tolist() for _ in range(6)]
    llm.generate([prompts[0]], one)  # warm-up: compiles and autotunes for this length
    walls = []
    for ids in prompts[1:4]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate([ids], one)
        walls.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm.generate([prompts[4]], one)
    torch.cuda.set_sync_debug_mode("default")
    sites = Counter(f"{Path(w.filename).as_posix().split('site-packages/')[-1]}:{w.lineno}"
                    for w in caught if "synchroniz" in str(w.message))
    prof = cProfile.Profile()
    prof.enable()
    llm.generate([prompts[5]], one)
    torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text).strip_dirs()
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(35)
    return {"tokens": n, "wall_ms_median": statistics.median(walls), "wall_ms_all": walls,
            "syncs": sum(sites.values()), "sync_sites": sites.most_common(40),
            "cprofile": text.getvalue()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--lens", default="8192,40")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp()) / "q08"
    write_checkpoint(preset("qwen3.5-0.8b"), work, seed=0)
    llm = LLM(work, dtype="bfloat16", device="cuda", prefix_cache_bytes=0, max_num_seqs=4,
              max_num_batched_tokens=8192)
    record = {"git_commit": git_commit(), "device": torch.cuda.get_device_name(), "cases": []}
    for n in (int(x) for x in args.lens.split(",")):
        case = _case(llm, n, seed=n)
        record["cases"].append(case)
        print(f"{n} tokens: wall {case['wall_ms_median']:.1f} ms, {case['syncs']} syncs", flush=True)
        for site, count in case["sync_sites"][:15]:
            print(f"    {count:4d} {site}", flush=True)
        print("\n".join(case["cprofile"].splitlines()[:45]), flush=True)
    Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
