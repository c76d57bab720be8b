"""H200, issue 6: the prefill conv's launch shape (what sets BLOCK_T / NUM_WARPS in
ops/triton_conv1d), with its bandwidth.

    python3 scripts/gpu/conv_tune.py --out conv_tune.json

0.8B GDN shape at 8k tokens (bf16, x a view of the in-projection's output with its longer row):
the plain conv ([T, C] out) and the q|k|v split with per-head L2 norms, per (BLOCK_T, num_warps),
each checked against its reference first; GPU time from CUDA events over 50 calls; GB/s counts x
read once and the output written once (the floor of both forms).
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from deltaserve.env import env  # noqa: E402
from deltaserve.ops import triton_conv1d as tc  # noqa: E402
from deltaserve.ops.conv1d import causal_conv1d_qkv_ref, causal_conv1d_ref  # noqa: E402


def _gpu_us(fn, repeats: int = 50) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / repeats


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    seq_len, key_dim, value_dim, head_dim, proj_cols = args.tokens, 2048, 2048, 128, 8224
    channels = 2 * key_dim + value_dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    proj = torch.randn(1, seq_len, proj_cols, device="cuda", generator=gen).bfloat16()
    x = proj[..., :channels]
    weight = torch.randn(channels, 4, device="cuda", generator=gen) * 0.5
    window = torch.randn(1, channels, 3, device="cuda", generator=gen).bfloat16()
    floor_bytes = 2 * seq_len * channels * 2
    rows = []
    plain_ref = causal_conv1d_ref(x[:, :512], weight, window)
    plain = tc.causal_conv1d_cuda(x[:, :512], weight, window)
    us = _gpu_us(lambda: tc.causal_conv1d_cuda(x, weight, window))
    rows.append({"form": "plain", "block_t": tc.BLOCK_T, "num_warps": tc.NUM_WARPS, "us": us,
                 "gb_s": floor_bytes / us / 1e3, "rel": _rel(plain, plain_ref)})
    print(json.dumps(rows[-1]), flush=True)
    want = causal_conv1d_qkv_ref(x[:, :512], weight, window, key_dim, head_dim)
    for block_t in (8, 16, 32, 64):
        for warps in (2, 4, 8):
            got = tc.causal_conv1d_qkv_cuda(x[:, :512], weight, window, key_dim, head_dim,
                                            block_t, warps)
            err = max(_rel(a, b) for a, b in zip(got, want, strict=True))
            us = _gpu_us(lambda b=block_t, w=warps: tc.causal_conv1d_qkv_cuda(
                x, weight, window, key_dim, head_dim, b, w))
            rows.append({"form": "qkv", "block_t": block_t, "num_warps": warps, "us": us,
                         "gb_s": floor_bytes / us / 1e3, "rel": err})
            print(json.dumps(rows[-1]), flush=True)
    record = {"kind": "h200-conv-tune", "git_commit": env().git_commit, "tokens": seq_len,
              "device": torch.cuda.get_device_name(), "rows": rows}
    Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
