"""H200, issue 6: the cuDNN split attention (ops/attention._split_attention) against FA2, per call.

    python3 scripts/gpu/attention_split_probe.py --out probe.json

A 32k prompt's chunks 2-4 (8,192 queries behind 8k / 16k / 24k cached keys; 8 query heads, 2 KV
heads, head dim 256, bf16) through three forms, each call timed on its own (wall, synchronized):
FA2's bottom-right causal kernel (chunks under 2,048 rows), cuDNN's internal op on the cached keys
(no mask) and on the chunk's own (causal) with their log-sum-exps merged (the split, longer chunks),
and each cuDNN part alone. Checked against FA2's output. A per-shape compile shows as a slow first call
(`split_first_call_ms`, timed before anything else runs that shape; 8256 and 8320 are cached
lengths that a prefix hit or a mixed batch gives).
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from deltaserve.bench.gpu import synced_ms  # noqa: E402
from deltaserve.env import env  # noqa: E402

HEADS, KV_HEADS, DIM = 8, 2, 256


def cudnn_part(q, k, v, causal: bool, scale: float):
    groups = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale)
    return out[0], out[1].reshape(q.shape[:3]).float()


def split(q, k, v, scale: float):
    cached = k.shape[2] - q.shape[2]
    o_old, lse_old = cudnn_part(q, k[:, :, :cached], v[:, :, :cached], False, scale)
    o_new, lse_new = cudnn_part(q, k[:, :, cached:], v[:, :, cached:], True, scale)
    lse = torch.logaddexp(lse_old, lse_new)
    return (o_old.float() * (lse_old - lse).exp()[..., None]
            + o_new.float() * (lse_new - lse).exp()[..., None]).to(q.dtype)


def fa2(q, k, v, scale: float):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(
        q.shape[2], k.shape[2]), scale=scale, enable_gqa=True)


def timed_ms(fn, calls: int = 4) -> list[float]:
    return [round(ms, 3) for ms in synced_ms(fn, calls)]


def measure(cached: int, queries: int) -> dict:
    scale = DIM**-0.5
    gen = torch.Generator(device="cuda").manual_seed(cached)
    total = cached + queries
    q = torch.randn(1, HEADS, queries, DIM, device="cuda", generator=gen).bfloat16()
    k, v = (torch.randn(1, KV_HEADS, total, DIM, device="cuda", generator=gen).bfloat16()
            for _ in range(2))
    first_ms = timed_ms(lambda: split(q, k, v, scale), 1)[0]  # a new shape: cuDNN builds a plan
    want = fa2(q, k, v, scale)
    got = split(q, k, v, scale)
    rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
    flops = 4 * queries * (cached + queries / 2) * DIM * HEADS
    old, new = (k[:, :, :cached], v[:, :, :cached]), (k[:, :, cached:], v[:, :, cached:])
    return {"cached": cached, "split_vs_fa2_rel": rel, "tflop": flops / 1e12,
            "split_first_call_ms": first_ms,
            "fa2_ms": timed_ms(lambda: fa2(q, k, v, scale)),
            "split_ms": timed_ms(lambda: split(q, k, v, scale)),
            "cudnn_cached_ms": timed_ms(lambda: cudnn_part(q, *old, False, scale)),
            "cudnn_own_ms": timed_ms(lambda: cudnn_part(q, *new, True, scale))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--queries", type=int, default=8192)
    ap.add_argument("--cached", default="8192,16384,24576,8256,8320")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = []
    for cached in (int(c) for c in args.cached.split(",")):
        rows.append(measure(cached, args.queries))
        print(json.dumps(rows[-1]), flush=True)
    Path(args.out).write_text(json.dumps({"kind": "h200-attention-split-probe",
                                          "git_commit": env().git_commit, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
