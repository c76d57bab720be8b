"""The word-wise Q4_K / Q6_K decode GEMVs (ops/triton_kquants) per launch shape on one GPU, beside
the byte-wise Q4_K kernel they replace (ops/triton_blocks), on the Qwen3.5-0.8B decode shapes;
every output checked against dequantize_blocks then a float64 GEMV first; writes JSON and, with
--write-table, the best config per shape into ops/tuning/gpu-triton-kquants.json.

    python scripts/gpu/kquant_bench.py --out $OUT/kquant.json --write-table

L2-cold as decode sees it (q1_bench.py's method: each graph replay reads copies of the weights
together >= 4x L2). The fused prologues (AddNorm, SiluMul) and PDL mode 2 are checked on the best
config of each shape.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from deltaserve.bench.gpu import graph_replay_s  # noqa: E402
from deltaserve.ops import gemv_prologue, triton_blocks, triton_kquants  # noqa: E402
from deltaserve.ops.tuning import HERE  # noqa: E402
from deltaserve.quant.ggml_blocks import dequantize_blocks  # noqa: E402

# 0.8B: GDN qkv, z / attention o-gate halves, out / o_proj, attention q|gate, k / v, gate|up, down,
# the tied head (Q6_K in Q4_K_M files)
SHAPES = {"q4_k": [(6144, 1024), (2048, 1024), (1024, 2048), (4096, 1024), (512, 1024),
                   (3584, 1024), (1024, 3584)],
          "q6_k": [(1024, 3584), (512, 1024), (2048, 1024), (248320, 1024)]}
CONFIGS = [(bn, nb, w) for bn in (4, 8, 16, 32) for nb in (1, 2, 4) for w in (2, 4)] + \
    [(8, 4, 8), (32, 4, 8), (4, 1, 1), (8, 1, 1)]
L2_BYTES = 50 * 2**20
SCALE_AT = {"q4_k": (0, 2), "q6_k": (208,)}


def blocks(kind, n, k, dev, gen):
    nbytes = 144 if kind == "q4_k" else 210
    raw = torch.randint(0, 256, (n, k // 256, nbytes), dtype=torch.uint8, device=dev,
                        generator=gen)
    for at in SCALE_AT[kind]:
        s = (torch.rand(n, k // 256, device=dev, generator=gen) * 0.018 + 0.002).half()
        raw[:, :, at:at + 2] = s.view(torch.uint8).view(n, k // 256, 2)
    return raw.view(n, -1)


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def shape_row(kind, n, k, dev, gen):
    first = blocks(kind, n, k, dev, gen)
    nbytes = first.numel()
    copies = [first] + [blocks(kind, n, k, dev, gen) for _ in range(max(1, 4 * L2_BYTES // nbytes))]
    x = torch.randn(1, k, device=dev, generator=gen)
    want = x.double() @ dequantize_blocks(first, kind).double().T
    row = {"kind": kind, "shape": [n, k], "bytes": nbytes, "copies": len(copies), "configs": []}
    if kind == "q4_k":  # the byte-wise kernel this replaces
        def old(w):
            y = torch.empty(1, n, device=dev)
            triton_blocks._k4_kernel[(triton_blocks.triton.cdiv(n, 16), 1)](
                w, w.view(torch.int16), x, y, n, k, w.shape[1], BYTES=144, FIVE=False, BLOCK_N=16)
            return y
        us = graph_replay_s([lambda w=w: old(w) for w in copies]) * 1e6
        row["byte_wise"] = {"us": us, "gbs": nbytes / us / 1e3, "rel_err": rel(old(first), want)}
    for cfg in CONFIGS:
        if cfg[1] * 256 > max(256, 2 * k):
            continue
        y = triton_kquants.gemv_kquant_cuda(x, first, kind, config=cfg)
        err = rel(y, want)
        us = graph_replay_s([lambda w=w, c=cfg: triton_kquants.gemv_kquant_cuda(x, w, kind, c)
                             for w in copies]) * 1e6
        row["configs"].append({"config": cfg, "us": us, "gbs": nbytes / us / 1e3, "rel_err": err})
    ok = [r for r in row["configs"] if r["rel_err"] < 1e-5]
    best = min(ok, key=lambda r: r["us"])
    row["best"] = best
    row["prologue_rel_err"] = prologue_checks(kind, first, x, best["config"])
    print(json.dumps({"kind": kind, "shape": [n, k], "best": best["config"],
                      "us": round(best["us"], 2), "gbs": round(best["gbs"], 1),
                      "byte_wise_us": round(row.get("byte_wise", {}).get("us", 0), 2),
                      "prologue": row["prologue_rel_err"]}), flush=True)
    return row


def prologue_checks(kind, w, x, cfg):
    k = x.shape[-1]
    wd = dequantize_blocks(w, kind).double().T
    res, nw = torch.randn_like(x).bfloat16(), (torch.randn(k, device=x.device) * 0.1).bfloat16()
    xb = x.bfloat16()
    total = torch.empty_like(res)
    y = triton_kquants.gemv_kquant_cuda(
        xb, w, kind, cfg, pdl=2, prologue=gemv_prologue.AddNorm(res, nw, 1e-6, 1.0, total))
    ref_in = gemv_prologue.apply_ref(xb, gemv_prologue.AddNorm(res, nw, 1e-6, 1.0,
                                                               torch.empty_like(res)))
    out = {"addnorm": rel(y, ref_in.double() @ wd), "total_equal": bool(torch.equal(total,
                                                                                    xb + res))}
    g = torch.randn(1, 2 * k, device=x.device).bfloat16()
    y = triton_kquants.gemv_kquant_cuda(g, w, kind, cfg, pdl=2, prologue=gemv_prologue.SiluMul())
    out["silumul"] = rel(y, gemv_prologue.apply_ref(g, gemv_prologue.SiluMul()).double() @ wd)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--write-table", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for kind, shapes in SHAPES.items():
        for n, k in shapes:  # written after every shape: a run cut short keeps what it measured
            rows.append(shape_row(kind, n, k, dev, gen))
            write(args, rows)


def write(args, rows):
    commit = os.environ.get("DELTASERVE_GIT_COMMIT", "")
    device = torch.cuda.get_device_name()
    record = {"kind": "gpu-kquant-gemv", "git_commit": commit, "device": device,
              "torch": torch.__version__, "default_config": triton_kquants.DEFAULT_CONFIG,
              "shapes": rows}
    Path(args.out).write_text(json.dumps(record))
    if args.write_table:
        path = HERE / "gpu-triton-kquants.json"
        table = json.loads(path.read_text())
        table["device"] = f"one {device}, L2-cold"
        table["rows"] = [{"key": [triton_kquants.BITS[r["kind"]], r["shape"][1], r["shape"][0],
                                  r["shape"][0] + 1], "value": list(r["best"]["config"]),
                          "record": Path(args.out).name, "commit": commit,
                          "note": f"{r['best']['us']:.1f} us, {r['best']['gbs']:.0f} GB/s"}
                         for r in rows]
        path.write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
