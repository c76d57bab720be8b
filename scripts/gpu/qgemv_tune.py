"""Tune the Triton quantized GEMV's launch config per Qwen3.5 decode shape on one GPU; writes JSON.

    python scripts/gpu/qgemv_tune.py --out $OUT/qgemv_tune.json [--jobs 12] [--formats int8,int4,q1]

Every config is first compiled by a pool of processes (Triton's disk cache), then timed in this one
process. Timing is L2-cold, as decode sees it (every weight is read once per token and the model
is far larger than L2): each CUDA-graph replay calls the GEMV once on each of several copies of the
weights, together >= 4x the L2 size; "hot" repeats one copy (L2-resident for the small shapes).
Each config's output is checked against dequantize-then-F.linear before it is timed. The best
config per shape goes into deltaserve/ops/triton_qgemv.TUNED by hand, citing the JSON.
"""

import argparse
import itertools
import json
import os
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from deltaserve.bench.gpu import cuda_median_s as timed  # noqa: E402
from deltaserve.bench.gpu import graph_replay_s as graphed  # noqa: E402
from deltaserve.ops.qgemv import qgemv_ref  # noqa: E402
from deltaserve.ops.triton_qgemv import qgemv_cuda  # noqa: E402
from deltaserve.quant.schemes import FORMATS, quantize  # noqa: E402

SHAPES = [(6144, 1024), (2048, 1024), (7168, 1024), (4096, 1024), (1024, 3584), (1024, 2048),
          (248320, 1024)]
TILES = [(1, 1024), (32, 512), (64, 128), (64, 256), (2, 256), (2, 512), (2, 1024), (4, 128),
         (4, 256), (4, 512), (4, 1024),
         (8, 128), (8, 256), (8, 512), (8, 1024), (16, 128), (16, 256), (16, 512), (32, 128),
         (32, 256)]
# num_stages 1 vs 3 made no difference in the first sweep (the K loop is 1-4 steps long)
CONFIGS = [(bn, bk, w, 1, magic)
           for (bn, bk), w, magic in itertools.product(TILES, (1, 2, 4, 8), (0, 1))]
L2_BYTES = 50 * 2**20


def configs_for(fmt):
    """q1 ignores the conversion flag (no int-to-float conversion) and needs whole groups of 128."""
    if fmt != "q1":
        return CONFIGS
    return [c for c in CONFIGS if c[4] == 0 and c[1] >= 128]


@triton.jit
def _noop(Y):
    tl.store(Y, 0.0)


HALF_SCALES: list[bool] = [False]  # --half-scales: fp16 scales and biases, as CUDA models hold them


def packed_for(fmt, n, k, dev, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    dtype = torch.float16 if HALF_SCALES[0] else torch.float32
    return {kk: (v.to(dtype) if v.is_floating_point() else v).to(dev)
            for kk, v in quantize(w, FORMATS[fmt]).items()}


def compile_some(job):
    fmt, configs, HALF_SCALES[0] = job
    dev = torch.device("cuda")
    p, x = packed_for(fmt, 256, 1024, dev), torch.randn(1, 1024, device=dev)
    for cfg in configs:
        qgemv_cuda(x, p, FORMATS[fmt], config=cfg)
    torch.cuda.synchronize()
    return len(configs)


def tune_shape(fmt, n, k, dev):
    s = FORMATS[fmt]
    nbytes_one = None
    copies = []
    x = torch.randn(1, k, device=dev)
    while not copies or (len(copies) < 64 and len(copies) * nbytes_one < 4 * L2_BYTES):
        copies.append(packed_for(fmt, n, k, dev, seed=len(copies)))
        nbytes_one = sum(v.numel() * v.element_size() for v in copies[0].values()) + 4 * k
    ref = qgemv_ref(x, copies[0], s)
    results = []
    for cfg in configs_for(fmt):
        try:
            out = qgemv_cuda(x, copies[0], s, config=cfg)
        except Exception as exc:  # a config the compiler rejects (registers, shared memory)
            results.append({"config": cfg, "error": str(exc)[:120]})
            continue
        err = ((out - ref).norm() / ref.norm()).item()
        cold = graphed([lambda p=p, cfg=cfg: qgemv_cuda(x, p, s, config=cfg) for p in copies])
        hot = graphed([lambda cfg=cfg: qgemv_cuda(x, copies[0], s, config=cfg)] * len(copies))
        results.append({"config": cfg, "rel_err": err, "cold_us": cold * 1e6, "hot_us": hot * 1e6})
    return nbytes_one, len(copies), results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--formats", default="int8,int4")
    ap.add_argument("--shapes", default="", help="NxK,... (default: every 0.8B decode shape)")
    ap.add_argument("--quick", action="store_true", help="9 tiles x 3 warp counts only")
    ap.add_argument("--magic", default="0,1", help="MAGIC values (ops/triton_qgemv), e.g. 0,2,4")
    ap.add_argument("--half-scales", action="store_true",
                    help="fp16 scales and biases (quant/linear.narrow_scales_ on CUDA)")
    args = ap.parse_args()
    formats = args.formats.split(",")
    HALF_SCALES[0] = args.half_scales
    global CONFIGS, SHAPES
    magics = [int(v) for v in args.magic.split(",")]
    CONFIGS = [(bn, bk, w, 1, m) for (bn, bk), w, m in itertools.product(TILES, (1, 2, 4, 8), magics)]
    if args.shapes:
        SHAPES = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    if args.quick:
        quick = {(2, 1024), (4, 512), (4, 1024), (8, 256), (8, 512), (8, 1024), (16, 256),
                 (16, 512), (32, 256)}
        CONFIGS = [c for c in CONFIGS if c[:2] in quick and c[2] in (2, 4, 8)]
    jobs = [(fmt, configs_for(fmt)[i::args.jobs], args.half_scales) for fmt in formats
            for i in range(args.jobs)]
    ctx = torch.multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
        compiled = sum(pool.map(compile_some, jobs))
    print(json.dumps({"compiled": compiled}), flush=True)
    dev = torch.device("cuda")
    big = torch.empty(2**30, dtype=torch.int16, device=dev)
    copy_gbs = 2 * big.numel() * 2 / timed(big.clone, 10) / 1e9
    del big
    y = torch.empty(1, device=dev)
    floor_us = graphed([lambda: _noop[(1,)](y)] * 64) * 1e6  # one launch in a graph, no work
    print(json.dumps({"copy_gbs": copy_gbs, "empty_kernel_us": floor_us}), flush=True)
    shapes = []
    for n, k in SHAPES:
        w, xb = torch.randn(n, k, device=dev).bfloat16(), torch.randn(1, k, device=dev).bfloat16()
        bf16_us = graphed([lambda w=w, xb=xb: F.linear(xb, w)] * 16) * 1e6
        for fmt in formats:
            nbytes, num_copies, results = tune_shape(fmt, n, k, dev)
            ok = [r for r in results if "cold_us" in r and r["rel_err"] < 1e-5]
            best = min(ok, key=lambda r: r["cold_us"])
            row = {"shape": [n, k], "format": fmt, "bytes": nbytes, "copies": num_copies,
                   "best": best, "cold_gbs": nbytes / best["cold_us"] / 1e3,
                   "frac_of_copy": nbytes / best["cold_us"] / 1e3 / copy_gbs,
                   "bf16_cublas_hot_us": bf16_us, "results": results}
            shapes.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "results"}), flush=True)
    commit = os.environ.get("DELTASERVE_GIT_COMMIT") or subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    record = {"kind": "h200-qgemv-tune", "git_commit": commit.strip(), "copy_gbs": copy_gbs,
              "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "empty_kernel_us": floor_us, "magic": magics,
              "half_scales": args.half_scales, "shapes": shapes}
    Path(args.out).write_text(json.dumps(record))
    print(json.dumps({"copy_gbs": copy_gbs}))


if __name__ == "__main__":
    main()
