"""Tune the dense Triton decode GEMV (ops/triton_gemv) per Qwen3.5 decode shape on one GPU, against
cuBLAS's F.linear on the same shapes in the same run; writes JSON.

    python scripts/gpu/gemv_tune.py --out $OUT/gemv_tune.json [--jobs 12]
    python scripts/gpu/gemv_tune.py --dry-run    # the shapes and configs only: no GPU, no triton

The shapes are every bf16 weight a batch-1 decode step multiplies (x [1, K] times W [N, K]) in the
qwen3.5-0.8b and qwen3.5-2b presets, derived from their configs. Every config is first compiled by
a pool of processes (Triton's disk cache), then timed in this one process. Timing is L2-cold, as
decode sees it (each weight is read once per token, the model is far larger than L2): each
CUDA-graph replay calls the GEMV once on each of several weight copies, together >= 4x the L2 size;
"hot" repeats one copy. Each config's output is checked against F.linear in fp32 before it is timed.
At the end it prints TUNED entries for ops/triton_gemv.py: only shapes where our best L2-cold time
beat cuBLAS's, each window exactly that shape's N.
"""

import argparse
import itertools
import json
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from deltaserve.bench.gpu import cuda_median_s as timed  # noqa: E402
from deltaserve.bench.gpu import graph_replay_s as graphed  # noqa: E402
from deltaserve.checkpoint.presets import preset  # noqa: E402
from deltaserve.config import FULL, LINEAR, TextConfig  # noqa: E402
from deltaserve.ops.backend import tl, triton  # noqa: E402
from deltaserve.ops.triton_gemv import gemv16_cuda  # noqa: E402

PRESETS = ("qwen3.5-0.8b", "qwen3.5-2b")
TILES = [(2, 1024), (4, 512), (4, 1024), (8, 256), (8, 512), (8, 1024), (16, 256), (16, 512),
         (32, 128), (32, 256)]
# (BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K). num_stages made no difference in qgemv's sweep
# (1-4 K steps); the long-K shapes here take up to 24 steps, so a few stage-3 probes check it again.
CONFIGS = [(bn, bk, w, 1, s) for (bn, bk), w, s in itertools.product(TILES, (2, 4, 8), (1, 2, 4))]
CONFIGS += [(bn, bk, 4, 3, 1) for bn, bk in [(4, 512), (8, 256), (8, 512), (16, 256)]]
REL_TOL = 8e-3  # a bf16 output rounds once: ~1e-3 relative; a wrong tile is off by far more
L2_FALLBACK_BYTES = 50 * 2**20  # H100 / H200, when torch does not report it

if triton is not None:

    @triton.jit
    def _noop(Y):
        tl.store(Y, 0.0)


def decode_shapes() -> list[dict]:
    """Each distinct (N, K) with its uses: preset, role, GEMVs per token (one per layer using it)."""
    by_shape: dict[tuple[int, int], dict] = {}
    for name in PRESETS:
        c = TextConfig.from_hf(preset(name).config)
        q_dim, kv_dim = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        gdn, attn = c.layer_types.count(LINEAR), c.layer_types.count(FULL)
        roles = [  # (role, N rows, K cols, per token): packed as layers/*.py pack them
            ("gdn_in_proj", c.conv_dim + c.linear_value_dim + 2 * c.linear_num_value_heads,
             c.hidden_size, gdn),
            ("gdn_out_proj", c.hidden_size, c.linear_value_dim, gdn),
            ("attn_qkv", 2 * q_dim + 2 * kv_dim, c.hidden_size, attn),
            ("attn_o", c.hidden_size, q_dim, attn),
            ("mlp_gate_up", 2 * c.intermediate_size, c.hidden_size, c.num_hidden_layers),
            ("mlp_down", c.hidden_size, c.intermediate_size, c.num_hidden_layers),
            ("head", c.vocab_size, c.hidden_size, 1),  # logits for sampling (greedy: triton_head)
        ]
        for role, n, k, count in roles:
            row = by_shape.setdefault((n, k), {"n": n, "k": k, "uses": []})
            row["uses"].append({"preset": name, "role": role, "per_token": count})
    return list(by_shape.values())


def applies(cfg, k: int) -> bool:
    """Split-K only where every split gets at least one full BLOCK_K step (else splits idle)."""
    _, block_k, _, _, split_k = cfg
    return split_k == 1 or k // split_k >= block_k


def compile_some(configs) -> int:
    dev = torch.device("cuda")
    w = torch.randn(256, 4096, device=dev).bfloat16()
    x = torch.randn(1, 4096, device=dev).bfloat16()
    for cfg in configs:
        gemv16_cuda(x, w, cfg)
    torch.cuda.synchronize()
    return len(configs)


def rel(out, ref) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def cold_and_hot_us(fn, copies) -> tuple[float, float]:
    """fn(weight) timed over every copy in turn (L2-cold), then over the first copy repeated."""
    cold = graphed([lambda w=w: fn(w) for w in copies])
    hot = graphed([lambda: fn(copies[0])] * len(copies))
    return cold * 1e6, hot * 1e6


def tune_shape(n: int, k: int, l2_bytes: int, dev) -> dict:
    nbytes = n * k * 2
    num_copies = max(1, min(64, -(-4 * l2_bytes // nbytes)))
    copies = [torch.randn(n, k, device=dev).bfloat16() for _ in range(num_copies)]
    x = torch.randn(1, k, device=dev).bfloat16()
    ref = F.linear(x.float(), copies[0].float())
    cublas_cold, cublas_hot = cold_and_hot_us(lambda w: F.linear(x, w), copies)
    cublas = {"cold_us": cublas_cold, "hot_us": cublas_hot, "rel_err": rel(F.linear(x, copies[0]), ref)}
    results = []
    for cfg in filter(lambda c: applies(c, k), CONFIGS):
        try:
            err = rel(gemv16_cuda(x, copies[0], cfg), ref)
        except Exception as exc:  # a config the compiler rejects (registers, shared memory)
            results.append({"config": cfg, "error": str(exc)[:120]})
            continue
        row = {"config": cfg, "rel_err": err}
        if err < REL_TOL:  # a wrong result is not timed: it could never be dispatched
            row["cold_us"], row["hot_us"] = cold_and_hot_us(
                lambda w, cfg=cfg: gemv16_cuda(x, w, cfg), copies)
        results.append(row)
    best = min((r for r in results if "cold_us" in r), key=lambda r: r["cold_us"])
    return {"bytes": nbytes, "copies": num_copies, "best": best, "cublas": cublas,
            "wins": best["cold_us"] < cublas["cold_us"], "results": results}


def per_token_us(shapes: list[dict]) -> dict:
    """Per preset, one decode step's GEMVs (L2-cold): all cuBLAS vs the winner per shape."""
    out = {name: {"cublas_us": 0.0, "tuned_us": 0.0} for name in PRESETS}
    for s in shapes:
        ours = s["best"]["cold_us"] if s["wins"] else s["cublas"]["cold_us"]
        for use in s["uses"]:
            out[use["preset"]]["cublas_us"] += use["per_token"] * s["cublas"]["cold_us"]
            out[use["preset"]]["tuned_us"] += use["per_token"] * ours
    return out


def print_tuned(shapes: list[dict]) -> None:
    print("\n# ready to paste into deltaserve/ops/triton_gemv.py (shapes where ours beat cuBLAS)")
    print("TUNED: dict[tuple[int, int, int], Config] = {")
    for s in sorted(shapes, key=lambda s: (s["k"], s["n"])):
        if s["wins"]:
            uses = ", ".join(f"{u['role']} {u['preset'].removeprefix('qwen3.5-')}" for u in s["uses"])
            print(f"    ({s['k']}, {s['n']}, {s['n'] + 1}): {tuple(s['best']['config'])},  # {uses}: "
                  f"{s['best']['cold_us']:.2f} vs cuBLAS {s['cublas']['cold_us']:.2f} us")
    print("}")


def dry_run() -> None:
    for s in decode_shapes():
        uses = ", ".join(f"{u['preset']} {u['role']} x{u['per_token']}" for u in s["uses"])
        count = sum(applies(c, s["k"]) for c in CONFIGS)
        print(f"{s['n']:>6} x {s['k']:<5} {count:>3} configs  {uses}")
    print(f"{len(CONFIGS)} configs in the sweep")


def measure_floor(dev) -> dict:
    """Copy bandwidth (a bound for the cold GEMVs) and one empty launch from a graph."""
    big = torch.empty(2**30, dtype=torch.int16, device=dev)
    copy_gbs = 2 * big.numel() * 2 / timed(big.clone, 10) / 1e9
    del big
    y = torch.empty(1, device=dev)
    floor_us = graphed([lambda: _noop[(1,)](y)] * 64) * 1e6
    return {"copy_gbs": copy_gbs, "empty_kernel_us": floor_us}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--dry-run", action="store_true", help="print the shapes and configs; no GPU")
    args = ap.parse_args()
    if args.dry_run:
        return dry_run()
    if not args.out:
        ap.error("--out is required (unless --dry-run)")
    ctx = torch.multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
        compiled = sum(pool.map(compile_some, [CONFIGS[i :: args.jobs] for i in range(args.jobs)]))
    dev = torch.device("cuda")
    l2_bytes = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0) or L2_FALLBACK_BYTES
    floor = measure_floor(dev)
    print(json.dumps({"compiled": compiled, "l2_bytes": l2_bytes, **floor}), flush=True)
    shapes = []
    for s in decode_shapes():
        s.update(tune_shape(s["n"], s["k"], l2_bytes, dev))
        s["cold_gbs"] = s["bytes"] / s["best"]["cold_us"] / 1e3
        shapes.append(s)
        torch.cuda.empty_cache()
        print(f"{s['n']:>6} x {s['k']:<5} best {tuple(s['best']['config'])}  ours "
              f"{s['best']['cold_us']:7.2f} us  cuBLAS {s['cublas']['cold_us']:7.2f} us  "
              f"{'WINS' if s['wins'] else 'loses'}", flush=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    record = {"kind": "h200-gemv-tune", "git_commit": commit.strip(),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "l2_bytes": l2_bytes, **floor,
              "per_token_gemv_us": per_token_us(shapes), "shapes": shapes}
    Path(args.out).write_text(json.dumps(record))
    print(json.dumps({"per_token_gemv_us": record["per_token_gemv_us"]}))
    print_tuned(shapes)


if __name__ == "__main__":
    main()
