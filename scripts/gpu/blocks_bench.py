"""GGUF block GEMVs on the GPU (ops/triton_blocks.py), one JSON record: per kind and 0.8B-shape
matrix, the GEMV's time (CUDA events over a few hundred launches), its read bandwidth, and the
same matrix as our int4 g64 (ops/triton_qgemv) and bf16 beside it; each checked against the
torch reference first (rel error recorded).

    python3 scripts/gpu/blocks_bench.py --out blocks.json
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import numpy as np
import torch

# 0.8B matrices (N, K): GDN in_proj qkvz, attention qkv+gate, MLP gate|up, MLP down
SHAPES = [(8192, 1024), (4608, 1024), (7168, 1024), (1024, 3584)]
KINDS = ("q4_k", "q5_k", "q6_k", "iq4_xs")


def timed(fn, iters: int = 300) -> float:
    for _ in range(10):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e3  # us


def random_blocks(kind: str, n: int, k: int) -> torch.Tensor:
    from deltaserve.quant.ggml_blocks import BLOCKS

    _, qk, nbytes, _ = BLOCKS[kind]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(n, k // qk, nbytes), dtype=np.uint8)
    scale_at = {"q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "iq4_xs": (0,)}[kind]
    for at in scale_at:
        raw[:, :, at:at + 2] = rng.uniform(0.002, 0.02, raw.shape[:2]).astype(np.float16)[
            ..., None].view(np.uint8)
    return torch.from_numpy(raw.reshape(n, -1)).cuda()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from deltaserve.bench.record import device_info, flags, git_commit
    from deltaserve.ops import triton_blocks, triton_qgemv
    from deltaserve.quant.ggml_blocks import dequantize_blocks
    from deltaserve.quant.schemes import Scheme, quantize

    rec = {"commit": git_commit(), "device": device_info("cuda"), "flags": flags(),
           "peer": "our int4 g64 and bf16 GEMVs on the same matrix (llama.cpp CUDA not built "
                   "in this run)", "rows": []}
    for n, k in SHAPES:
        x = torch.randn(1, k, device="cuda")
        dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        xb = x.bfloat16()
        int4 = Scheme("affine", 4, 64)
        packed = {key: v.cuda() for key, v in quantize(dense.float().cpu(), int4).items()}
        row = {"shape": [n, k],
               "bf16_us": timed(partial(torch.nn.functional.linear, xb, dense)),
               "int4_g64_us": timed(partial(triton_qgemv.qgemv_cuda, x, packed, int4))}
        for kind in KINDS:
            w = random_blocks(kind, n, k)
            y = triton_blocks.gemv_blocks_cuda(x, w, kind)
            want = x.double() @ dequantize_blocks(w, kind).double().T
            us = timed(partial(triton_blocks.gemv_blocks_cuda, x, w, kind))
            row[kind] = {"us": us, "GBps": w.numel() / us / 1e3,
                         "rel": float((y - want).norm() / want.norm())}
        rec["rows"].append(row)
        print(json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
