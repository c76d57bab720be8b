"""Time the Triton int8 decode-batch GEMM (ops/triton_qgemm) per 0.8B shape and batch size against
cuBLAS on the dequantized bf16 weights, L2-cold; writes JSON.

    python scripts/gpu/qgemm_tune.py --out $OUT/qgemm_tune.json [--rows 8,32,128]

For each (shape, rows): the default launch_config, a sweep of alternatives (tile width, K split,
warps, stages), and F.linear on bf16 weights (what the bf16 engine runs). Each config's output is
checked against dequantize-then-F.linear (fp32) before it is timed. Timing as qgemv_tune.py: one
CUDA-graph replay calls the kernel once on each of several weight copies, >= 4x the L2 together.
"""

import argparse
import itertools
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from deltaserve.bench.gpu import graph_replay_s as graphed  # noqa: E402
from deltaserve.bench.record import git_commit  # noqa: E402
from deltaserve.ops import triton_qgemm as qg  # noqa: E402
from deltaserve.quant.schemes import FORMATS, dequantize, quantize  # noqa: E402

SHAPES = [(8224, 1024), (1024, 2048), (7168, 1024), (1024, 3584), (5120, 1024), (248320, 1024)]
L2_BYTES = 50 * 2**20
SCHEME = FORMATS["int8"]


def configs_for(rows: int):
    block_ms = sorted({min(128, max(16, 1 << (rows - 1).bit_length())), 64 if rows > 64 else 16})
    return [qg.Config(bm, bn, split, w, st) for bm, bn, split, w, st in itertools.product(
        block_ms, (32, 64, 128), (1, 2, 4, 8), (4, 8), (3, 4))]


def packed_for(n, k, dev, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    return {kk: (v.float() if v.is_floating_point() else v).to(dev)
            for kk, v in quantize(w, SCHEME).items()}


def compile_some(job):
    rows, configs = job
    dev = torch.device("cuda")
    p, x = packed_for(256, 1024, dev), torch.randn(rows, 1024, device=dev).bfloat16()
    for cfg in configs:
        try:
            qg.qgemm_cuda(x, p, SCHEME, cfg)
        except Exception:  # noqa: BLE001 (a config the compiler rejects; timed as an error later)
            pass
    torch.cuda.synchronize()
    return len(configs)


def weight_copies(n, k, dev):
    copies, nbytes = [], 0
    while not copies or (len(copies) < 32 and len(copies) * nbytes < 4 * L2_BYTES):
        copies.append(packed_for(n, k, dev, seed=len(copies)))
        nbytes = sum(v.numel() * v.element_size() for v in copies[0].values())
    return copies, nbytes


def tune(n, k, rows, dev, copies, nbytes):
    x = torch.randn(rows, k, device=dev).bfloat16()
    ref = F.linear(x.float(), dequantize(copies[0], SCHEME, torch.float32))
    dense = [dequantize(p, SCHEME, torch.bfloat16) for p in copies[: max(2, len(copies) // 2)]]
    cublas_us = graphed([lambda w=w: F.linear(x, w) for w in dense]) * 1e6
    del dense
    auto = qg.launch_config(rows, n, k, SCHEME.group_size)
    results = []
    for cfg in [auto] + configs_for(rows):
        try:
            out = qg.qgemm_cuda(x, copies[0], SCHEME, cfg)
        except Exception as exc:  # noqa: BLE001
            results.append({"config": list(cfg), "error": str(exc)[:120]})
            continue
        err = ((out.float() - ref).norm() / ref.norm()).item()
        us = graphed([lambda p=p, cfg=cfg: qg.qgemm_cuda(x, p, SCHEME, cfg) for p in copies]) * 1e6
        results.append({"config": list(cfg), "rel_err": err, "cold_us": us})
    ok = [r for r in results if "cold_us" in r and r["rel_err"] < 8e-3]
    if not ok:
        raise RuntimeError(f"no config of {n}x{k} at {rows} rows passed the accuracy check")
    best = min(ok, key=lambda r: r["cold_us"])
    return {"shape": [n, k], "rows": rows, "bytes": nbytes, "copies": len(copies),
            "cublas_bf16_us": cublas_us, "auto": results[0], "best": best,
            "best_tflops": 2 * rows * n * k / best["cold_us"] / 1e6, "results": results}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="8,32,128")
    ap.add_argument("--jobs", type=int, default=12)
    args = ap.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    jobs = [(r, configs_for(r)[i::args.jobs]) for r in rows_list for i in range(args.jobs)]
    with ProcessPoolExecutor(args.jobs, mp_context=torch.multiprocessing.get_context("spawn")) as p:
        print(json.dumps({"compiled": sum(p.map(compile_some, jobs))}), flush=True)
    dev = torch.device("cuda")
    cases = []
    for n, k in SHAPES:
        copies, nbytes = weight_copies(n, k, dev)
        for rows in rows_list:
            row = tune(n, k, rows, dev, copies, nbytes)
            cases.append(row)
            print(json.dumps({kk: v for kk, v in row.items() if kk != "results"}), flush=True)
        del copies
    total = {r: {"auto_us": sum(c["auto"]["cold_us"] for c in cases if c["rows"] == r
                                and c["shape"][0] != 248320),
                 "best_us": sum(c["best"]["cold_us"] for c in cases if c["rows"] == r
                                and c["shape"][0] != 248320),
                 "cublas_bf16_us": sum(c["cublas_bf16_us"] for c in cases if c["rows"] == r
                                       and c["shape"][0] != 248320)} for r in rows_list}
    print(json.dumps({"layer_shapes_total": total}), flush=True)
    Path(args.out).write_text(json.dumps({
        "kind": "h200-qgemm-tune", "git_commit": git_commit(), "torch": torch.__version__,
        "device": torch.cuda.get_device_name(), "layer_shapes_total": total, "cases": cases}))


if __name__ == "__main__":
    main()
