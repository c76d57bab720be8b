"""CPU decode-GEMV timing per quantized format, the kernels side by side with bf16:

    python scripts/cpu/qgemv_bench.py --out qgemv_cpu.json                  # int8
    python scripts/cpu/qgemv_bench.py --format int4 --out qgemv_cpu_int4.json

int8: exact (fp32 x) vs VNNI (x quantized per group), both on fp32 scales, and VNNI again on fp16
scales (vnni_f16: what loaded models hold since 12-01). int4 (4-bit affine, group 64): exact on
fp32 and on fp16 scales and biases vs VNNI on fp16 (ds_gemv_a4_vnni). The winners between exact
and VNNI per shape are the dispatch tables in deltaserve/ops/qgemv.py.

2 threads (torch.set_num_threads(2)). Each figure is the median of >= 10 calls after warm-up, in
the fastest of 5 rounds (the host is shared: a neighbour's load only ever slows a round; every
round's median is in the JSON). Calls go through a Python entry of the same cost (allocate y, one
ctypes call; bf16 is ops.gemv.gemv), the kernels taking turns call by call.

"hot" repeats one matrix (small shapes then sit in L2/L3: a microbenchmark); "cold" rotates
through copies filling --pool-mb, so each call streams from DRAM as decode does (a model's
weights exceed the L3). Matrices sit on 2 MiB pages (THP madvise), as loaded weights do. GB/s
counts codes + scales (+ biases) in the kernel's dtype + x (bf16: 2 bytes/weight + x), beside the
streaming-read bandwidth of an fp32 torch GEMV over a 256 MB matrix, measured at the start and at
the end.
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
from deltaserve.ops.qgemv import SCALE_KINDS, qgemv_ref  # noqa: E402
from deltaserve.quant.schemes import FORMATS, quantize  # noqa: E402

SHAPES = [(6144, 1024), (2048, 1024), (7168, 1024), (1024, 3584), (1024, 2048), (4096, 1024),
          (248320, 1024)]
THREADS = 2
GROUP = 64


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


def kernel_call(kernel, fmt: str, half: bool):
    """The kernel on p's fp16 ("half") or fp32 scales (and biases): the same values."""
    suffix = "16" if half else ""

    def call(x: torch.Tensor, p: dict) -> torch.Tensor:
        w, s = p["weight"], p["scales" + suffix]
        biases = [p["biases" + suffix].data_ptr()] if fmt == "int4" else []
        out = torch.empty(1, w.shape[0], dtype=torch.float32)
        kernel(w.data_ptr(), s.data_ptr(), *biases, x.data_ptr(), out.data_ptr(), w.shape[0],
               x.shape[-1], GROUP, THREADS, SCALE_KINDS[s.dtype])
        return out
    return call


def kernels_for(lib, fmt: str) -> dict:
    """name -> (call, scale bytes): the exact and VNNI kernels of `fmt` on fp32 / fp16 scales."""
    if fmt == "int8":
        exact, vnni = lib.ds_gemv_q8, lib.ds_gemv_q8_vnni
        table = {"exact": (exact, False), "vnni": (vnni, False), "vnni_f16": (vnni, True)}
    else:
        exact, vnni = lib.ds_gemv_a4, lib.ds_gemv_a4_vnni
        table = {"exact": (exact, False), "exact_f16": (exact, True), "vnni_f16": (vnni, True)}
    return {name: (kernel_call(fn, fmt, half), 2 if half else 4)
            for name, (fn, half) in table.items()}


def stream_gbs() -> float:
    """Streaming-read bandwidth: torch fp32 GEMV over 256 MB (x, y negligible)."""
    w, x = huge((65536, 1024), torch.float32).normal_(), torch.randn(1024)
    return w.numel() * 4 / min(interleaved({"mv": lambda i: torch.mv(w, x)}, 10)["mv"]) / 1e9


def rel_err_vs_spec(n: int, k: int, fmt: str, vnni) -> float | None:
    """VNNI vs dequantize-then-F.linear on gaussian weights/x (skipped for the head: 1 GB fp32)."""
    if n * k > 2**23:
        return None
    torch.manual_seed(n + k)
    p = quantize(torch.randn(n, k), FORMATS[fmt])
    if fmt == "int4":  # the C kernel reads bytes
        p["weight"] = p["weight"].view(torch.uint8)
    p = {**p, **{name + "16": v for name, v in p.items() if v.is_floating_point()}}
    x = torch.randn(1, k)
    ref = qgemv_ref(x, {**p, "weight": p["weight"].view(torch.int32 if fmt == "int4" else
                                                                 torch.int8)}, FORMATS[fmt])
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


def random_packs(n: int, k: int, fmt: str, copies: int) -> list:
    """Random codes, fp16 scales (and biases) and their fp32 copies, on 2 MiB pages."""
    packs = []
    for _ in range(copies):
        if fmt == "int8":
            p = {"weight": huge((n, k), torch.int8).random_(-127, 128)}
        else:
            p = {"weight": huge((n, k // 2), torch.uint8).random_(0, 256),
                 "biases16": (torch.randn(n, k // GROUP) * 1e-2).half()}
        p["scales16"] = (torch.rand(n, k // GROUP) * 1e-3).half()
        p.update({name[:-2]: v.float() for name, v in list(p.items()) if name.endswith("16")})
        packs.append(p)
    return packs


def time_regime(n: int, k: int, fmt: str, copies: dict, nbytes: dict, kernels: dict) -> dict:
    """Median seconds per kernel, each call on the next of copies[format] matrices."""
    x = torch.randn(1, k)
    packs = random_packs(n, k, fmt, copies["quant"])
    ws = [huge((n, k), torch.bfloat16).normal_() for _ in range(copies["bf16"])]
    calls = {name: cycling(call, x, packs, len(kernels), j)
             for j, (name, (call, _)) in enumerate(kernels.items())}
    calls["bf16"] = cycling(gemv, x, ws)
    return interleaved(calls, max(10, min(100, int(1e9 / nbytes["bf16"]))))


def time_shape(n: int, k: int, fmt: str, pool_bytes: int, kernels: dict) -> dict:
    """Hot: one matrix; cold: each call the next of copies filling pool_bytes (per format)."""
    codes, groups = n * k // (1 if fmt == "int8" else 2), n * (k // GROUP)
    per_group = 1 if fmt == "int8" else 2  # scales (and biases)
    nbytes = {name: codes + groups * per_group * width + k * 4
              for name, (_, width) in kernels.items()}
    nbytes["bf16"] = n * k * 2 + k * 4
    row = {"shape": [n, k], "format": fmt, "bytes": nbytes}
    quant_bytes = codes + groups * per_group * 6  # both scale copies sit in each pack
    for regime in ("hot", "cold"):
        copies = {f: 1 if regime == "hot" else max(2, math.ceil(pool_bytes / b))
                  for f, b in (("quant", quant_bytes), ("bf16", nbytes["bf16"]))}
        for name, secs in time_regime(n, k, fmt, copies, nbytes, kernels).items():
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
    ap.add_argument("--format", choices=("int8", "int4"), default="int8")
    ap.add_argument("--pool-mb", type=int, default=768, help="cold regime: bytes of copies rotated")
    args = ap.parse_args()
    torch.set_num_threads(THREADS)
    lib = native_lib()
    if lib is None or not hasattr(lib, "ds_gemv_q8_vnni"):
        sys.exit("needs the native library built with AVX512-VNNI")
    kernels = kernels_for(lib, args.format)
    names = [*kernels, "bf16"]
    bw = stream_gbs()  # again at the end: a shared host's bandwidth drifts
    rows = []
    head = f"{'N x K':>13} {'regime':>6} | " + " | ".join(f"{n + ' us':>12} {'GB/s':>5}"
                                                         for n in names)
    print(f"streaming read (fp32 torch GEMV, 256 MB): {bw:.1f} GB/s\n{head} | speed-ups")
    first, vnni = names[0], next(n for n in names if n.startswith("vnni"))
    for n, k in SHAPES:
        row = time_shape(n, k, args.format, args.pool_mb << 20, kernels)
        row["vnni_rel_l2_vs_spec"] = rel_err_vs_spec(n, k, args.format, kernels[vnni][0])
        rows.append(row)
        for r in ("hot", "cold"):
            cells = " | ".join(f"{row[f'{r}_{m}_us']:12.1f} {row[f'{r}_{m}_gbs']:5.1f}"
                               for m in names)
            speed = " ".join(f"{m}/{first} {row[f'{r}_{first}_us'] / row[f'{r}_{m}_us']:.3f}x"
                             for m in names[1:-1])
            print(f"{n:>6} x {k:<5} {r:>6} | {cells} | {speed}", flush=True)
    bw_end = stream_gbs()
    print(f"streaming read at the end: {bw_end:.1f} GB/s")
    repo = Path(__file__).resolve().parents[2]
    git = [subprocess.run(["git", *a], capture_output=True, text=True, cwd=repo).stdout.strip()
           for a in (["rev-parse", "HEAD"], ["status", "--porcelain", "--untracked-files=no"])]
    commit = git[0] + ("+uncommitted" if git[1] else "")
    record = {"kind": "cpu-qgemv", "format": args.format, "date": datetime.date.today().isoformat(),
              "git_commit": commit, "cpu": cpu_model(), "threads": THREADS,
              "torch": torch.__version__, "stream_read_gbs": [bw, bw_end], "pool_mb": args.pool_mb,
              "rows": rows, "note": f"{args.format} group {GROUP}; kernels named *_f16 read fp16 "
              "scales (and biases), the others fp32; GB/s = bytes read / median time"}
    Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
