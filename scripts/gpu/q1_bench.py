"""The q1 decode GEMVs side by side on one GPU: the exact one (ops/triton_qgemv, fp32 x) and the
int8-activation one (ops/triton_q1, its activation kernel included) per launch shape, on the
Qwen3.5-27B and -0.8B decode shapes; writes JSON.

    python scripts/gpu/q1_bench.py --out $OUT/q1_bench.json

L2-cold as decode sees it (qgemv_tune.py's method: each graph replay reads several copies of the
weights, together >= 4x L2); every output is checked against its spec first (qgemv_ref for the
exact kernel, qgemv_act_ref for the int8-activation one).
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from deltaserve.bench.gpu import graph_replay_s  # noqa: E402
from deltaserve.ops import triton_q1, triton_qgemv  # noqa: E402
from deltaserve.ops.qgemv import qgemv_act_ref, qgemv_ref  # noqa: E402
from deltaserve.quant.schemes import FORMATS, quantize  # noqa: E402

# 27B: GDN qkv|z|b|a, GDN out / attention o, MLP gate|up, down, attention q|gate; 0.8B: gate|up, down
SHAPES = [(16480, 5120), (5120, 6144), (34816, 5120), (5120, 17408), (14336, 5120),
          (7168, 1024), (1024, 3584)]
CONFIGS = [(8, 32, 4), (16, 32, 4), (16, 64, 4), (32, 32, 8), (32, 64, 8), (8, 64, 2), (64, 32, 8),
           (4, 64, 4)]
L2_BYTES = 50 * 2**20


def packed(n, k, dev):
    p = quantize(torch.randn(n, k) * 0.05, FORMATS["q1"])
    return {name: (t.half() if t.is_floating_point() else t).to(dev) for name, t in p.items()}


def shape_row(n, k, dev):
    s = FORMATS["q1"]
    first = packed(n, k, dev)
    nbytes = sum(t.numel() * t.element_size() for t in first.values())
    copies = [first] + [{"weight": torch.randint(0, 256, first["weight"].shape, dtype=torch.uint8,
                                                  device=dev), "scales": first["scales"].clone()}
                        for _ in range(max(1, 4 * L2_BYTES // nbytes))]
    x = torch.randn(1, k, device=dev).bfloat16()
    cpu = {name: t.cpu() for name, t in first.items()}
    row = {"shape": [n, k], "bytes": nbytes, "copies": len(copies)}
    ref = qgemv_ref(x.float().cpu(), cpu, s)
    err = (triton_qgemv.qgemv_cuda(x, first, s).float().cpu() - ref).norm() / ref.norm()
    us = graph_replay_s([lambda p=p: triton_qgemv.qgemv_cuda(x, p, s) for p in copies]) * 1e6
    row["exact"] = {"us": us, "rel_err_bf16_out": err.item(), "gbs": nbytes / us / 1e3}
    ref = qgemv_act_ref(x.float().cpu(), cpu, s)
    row["a8"] = []
    for cfg in CONFIGS:
        y = triton_q1.q1_gemv_a8_cuda(x.float(), first, s, config=cfg).cpu()
        err = ((y - ref).norm() / ref.norm()).item()
        us = graph_replay_s([lambda p=p, c=cfg: triton_q1.q1_gemv_a8_cuda(x, p, s, config=c)
                             for p in copies]) * 1e6
        row["a8"].append({"config": cfg, "us": us, "rel_err_fp32": err, "gbs": nbytes / us / 1e3})
    best = min(row["a8"], key=lambda r: r["us"])
    print(json.dumps({"shape": [n, k], "exact_us": round(row["exact"]["us"], 2),
                      "a8_best": best["config"], "a8_us": round(best["us"], 2),
                      "a8_gbs": round(best["gbs"], 1), "err": best["rel_err_fp32"]}), flush=True)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = [shape_row(n, k, dev) for n, k in SHAPES]
    record = {"kind": "gpu-q1-gemv", "git_commit": os.environ.get("DELTASERVE_GIT_COMMIT", ""),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "default_config": triton_q1.DEFAULT, "shapes": rows}
    Path(args.out).write_text(json.dumps(record))


if __name__ == "__main__":
    main()
