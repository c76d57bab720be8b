"""CPU decode-GEMV timing: int8 exact (fp32 x) vs int8 VNNI (x quantized per group) vs bf16.

    python scripts/cpu/qgemv_bench.py --out qgemv_cpu.json

2 threads (torch.set_num_threads(2)). Each figure is the median of >= 10 calls after warm-up, in
the fastest of 5 rounds (the host is shared: a neighbour's load only ever slows a round; every
round's median is in the JSON). Calls go through a Python entry of the same cost (allocate y, one
ctypes call; bf16 is ops.gemv.gemv), the kernels taking turns call by call.

"hot" repeats one matrix (small shapes then sit in L2/L3: a microbenchmark); "cold" rotates
through copies filling --pool-mb, so each call streams from DRAM as decode does (a model's
weights exceed the L3). Matrices sit on 2 MiB pages (THP madvise), as loaded weights do. GB/s
counts codes + fp32 scales + x (bf16: 2 bytes/weight + x), beside the streaming-read bandwidth
of an fp32 torch GEMV over a 256 MB matrix, measured at the start and at the end.
"""

import argparse
import datetime
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from deltaserve.checkpoint.memory import advise_huge_pages  # noqa: E402
from deltaserve.ops.gemv import gemv  # noqa: E402
from deltaserve.ops.native import native_lib  # noqa: E402
from deltaserve.ops.qgemv import qgemv_ref  # noqa: E402
from deltaserve.quant.schemes import INT8, quantize  # noqa: E402

SHAPES = [(6144, 1024), (2048, 1024), (7168, 1024), (1024, 3584), (1024, 2048), (4096, 1024),
          (248320, 1024)]
THREADS = 2


def interleaved(calls: dict, reps: int, rounds: int = 5, warmup: int = 2) -> dict:
    """Per fn: the medians of `rounds` rounds of `reps` calls, the fns taking turns call by call
    (a shared host's bandwidth drifts over seconds; turns spread that over all fns alike)."""
    medians = {name: [] for name in calls}
    for _ in range(rounds):
        times = {name: [] for name in calls}
        for i in range(warmup + reps):
            for name, fn in calls.items():
                t = time.perf_counter()
                fn(i)
                if i >= warmup:
                    times[name].append(time.perf_counter() - t)
        for name, ts in times.items():
            medians[name].append(statistics.median(ts))
    return medians


def q8_call(kernel):
    def call(x: torch.Tensor, p: dict) -> torch.Tensor:
        w = p["weight"]
        out = torch.empty(1, w.shape[0], dtype=torch.float32)
        kernel(w.data_ptr(), p["scales"].data_ptr(), x.data_ptr(), out.data_ptr(), w.shape[0],
               x.shape[-1], INT8.group_size, THREADS)
        return out
    return call


def stream_gbs() -> float:
    """Streaming-read bandwidth: torch fp32 GEMV over 256 MB (x, y negligible)."""
    w, x = huge((65536, 1024), torch.float32).normal_(), torch.randn(1024)
    return w.numel() * 4 / min(interleaved({"mv": lambda i: torch.mv(w, x)}, 10)["mv"]) / 1e9


def rel_err_vs_spec(n: int, k: int, vnni) -> float | None:
    """VNNI vs dequantize-then-F.linear on gaussian weights/x (skipped for the head: 1 GB fp32)."""
    if n * k > 2**23:
        return None
    torch.manual_seed(n + k)
    p = {kk: v.float() if v.is_floating_point() else v
         for kk, v in quantize(torch.randn(n, k), INT8).items()}
    x = torch.randn(1, k)
    ref = qgemv_ref(x, p, INT8)
    return ((vnni(x, p) - ref).norm() / ref.norm()).item()


def huge(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor on 2 MiB pages where THP allows, as the loader puts weights."""
    t = torch.empty(shape, dtype=dtype)
    advise_huge_pages([t])
    return t


def cycling(call, x: torch.Tensor, mats: list, stride: int = 1, offset: int = 0):
    """fn(i) = call(x, mats[i * stride + offset]): with stride = the number of kernels sharing
    `mats`, each call takes a matrix none has touched for a whole rotation."""
    return lambda i: call(x, mats[(i * stride + offset) % len(mats)])


def time_regime(n: int, k: int, copies: dict, nbytes: dict, kernels: dict) -> dict:
    """Median seconds per kernel, each call on the next of copies[format] matrices."""
    x = torch.randn(1, k)
    packs = [{"weight": huge((n, k), torch.int8).random_(-127, 128),
              "scales": torch.rand(n, k // INT8.group_size) * 1e-3} for _ in range(copies["exact"])]
    ws = [huge((n, k), torch.bfloat16).normal_() for _ in range(copies["bf16"])]
    calls = {name: cycling(call, x, packs, len(kernels), j)
             for j, (name, call) in enumerate(kernels.items())}
    calls["bf16"] = cycling(gemv, x, ws)
    return interleaved(calls, max(10, min(100, int(1e9 / nbytes["bf16"]))))


def time_shape(n: int, k: int, pool_bytes: int, kernels: dict) -> dict:
    """Hot: one matrix; cold: each call the next of copies filling pool_bytes (per format)."""
    nbytes = {"exact": n * k + n * (k // INT8.group_size) * 4 + k * 4, "bf16": n * k * 2 + k * 4}
    nbytes["vnni"] = nbytes["exact"]
    row = {"shape": [n, k], "int8_bytes": nbytes["exact"], "bf16_bytes": nbytes["bf16"]}
    for regime in ("hot", "cold"):
        copies = {f: 1 if regime == "hot" else max(2, math.ceil(pool_bytes / nbytes[f]))
                  for f in ("exact", "bf16")}
        for name, secs in time_regime(n, k, copies, nbytes, kernels).items():
            # the quietest round: a neighbour's load only ever slows a round down
            row[f"{regime}_{name}_us"] = min(secs) * 1e6
            row[f"{regime}_{name}_gbs"] = nbytes[name] / min(secs) / 1e9
            row[f"{regime}_{name}_round_us"] = [s * 1e6 for s in secs]
    return row


def cpu_model() -> str:
    """The model name plus the flags these kernels care about (a VM's name is often generic)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                 if line.startswith("model name")), platform.processor())
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines()
                  if line.startswith("flags")), [])
    wanted = [f for f in flags if f.startswith(("avx512", "amx")) or f == "avx_vnni"]
    return f"{name} [{' '.join(wanted)}]"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--pool-mb", type=int, default=768, help="cold regime: bytes of copies rotated")
    args = ap.parse_args()
    torch.set_num_threads(THREADS)
    lib = native_lib()
    if lib is None or not hasattr(lib, "ds_gemv_q8_vnni"):
        sys.exit("needs the native library built with AVX512-VNNI")
    kernels = {"exact": q8_call(lib.ds_gemv_q8), "vnni": q8_call(lib.ds_gemv_q8_vnni)}
    bw = stream_gbs()  # again at the end: a shared host's bandwidth drifts
    rows = []
    head = f"{'N x K':>13} {'regime':>6} | {'exact us':>9} {'GB/s':>5} | {'vnni us':>9} {'GB/s':>5}" \
           f" | {'bf16 us':>9} {'GB/s':>5} | vnni/exact"
    print(f"streaming read (fp32 torch GEMV, 256 MB): {bw:.1f} GB/s\n{head}")
    for n, k in SHAPES:
        row = time_shape(n, k, args.pool_mb << 20, kernels)
        row["vnni_rel_l2_vs_spec"] = rel_err_vs_spec(n, k, kernels["vnni"])
        rows.append(row)
        for r in ("hot", "cold"):
            cells = " | ".join(f"{row[f'{r}_{m}_us']:9.1f} {row[f'{r}_{m}_gbs']:5.1f}"
                               for m in ("exact", "vnni", "bf16"))
            speed = row[f"{r}_exact_us"] / row[f"{r}_vnni_us"]
            print(f"{n:>6} x {k:<5} {r:>6} | {cells} | {speed:.2f}x", flush=True)
    bw_end = stream_gbs()
    print(f"streaming read at the end: {bw_end:.1f} GB/s")
    repo = Path(__file__).resolve().parents[2]
    git = [subprocess.run(["git", *a], capture_output=True, text=True, cwd=repo).stdout.strip()
           for a in (["rev-parse", "HEAD"], ["status", "--porcelain", "--untracked-files=no"])]
    commit = git[0] + ("+uncommitted" if git[1] else "")
    record = {"kind": "cpu-qgemv", "date": datetime.date.today().isoformat(), "git_commit": commit,
              "cpu": cpu_model(), "threads": THREADS, "torch": torch.__version__,
              "stream_read_gbs": [bw, bw_end], "pool_mb": args.pool_mb, "rows": rows,
              "note": "int8 group 64, fp32 scales; GB/s = bytes read / median time"}
    Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
