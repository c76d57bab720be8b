"""Why the int4 vocabulary head's faster tile (qgemv_tune: 59.2 -> 51.8 us alone) did not move decode:
int4 batch-1 decode on the 0.8B shape with the head's launch varied, everything else the engine's.

    python3 scripts/gpu/head_probe.py --model /tmp/q08 --out head.json
    python3 scripts/gpu/head_probe.py --kernel --out head-kernel.json

--kernel times the head GEMV alone instead (qgemv_tune's way: CUDA-graph replays over two copies
of the weights, L2-cold), per tile x x dtype (fp32 as the sweep, bf16 as the engine) x launch (plain,
PDL as the engine), each checked against dequantize-then-F.linear.

Variants: the head's TUNED entry (16 x 512 as before, 32 x 512 now) x its launch (with PDL as
the engine does, or a plain launch: the head's own launches only, every other kernel keeps PDL).
Each variant is a fresh LLM (its CUDA graphs are captured with that launch), sampling head and
greedy head, rounds interleaved so drift between them shows. One JSON with every run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from deltaserve.engine.llm import LLM  # noqa: E402
from deltaserve.engine.sampling import SamplingParams  # noqa: E402
from deltaserve.ops import triton_qgemv, tuning  # noqa: E402
from deltaserve.quant.convert import quantize_checkpoint  # noqa: E402

HEAD_KEY = (4, 1024, 16384, tuning.OPEN)
TILES = {"16x512": (16, 512, 2, 1, 4), "32x512": (32, 512, 2, 1, 4)}
_launch = triton_qgemv._launch


def set_variant(tile: str, head_pdl: bool) -> None:
    triton_qgemv.TUNED[HEAD_KEY] = TILES[tile]  # the sampling head
    triton_qgemv.TUNED_ARGMAX[HEAD_KEY] = TILES[tile]  # the greedy head

    def launch(x, p, scheme, w, y, yi, config, argmax, pdl=False, prologue=None):
        if w.shape[0] >= 16384 and not head_pdl:  # only the head's launch changes
            pdl = False
        return _launch(x, p, scheme, w, y, yi, config, argmax, pdl, prologue)

    triton_qgemv._launch = launch


def decode_rates(model_dir: Path, greedy: bool, reps: int) -> list[float]:
    llm = LLM(model_dir, dtype="bfloat16", device="cuda", prefix_cache_bytes=0, max_num_seqs=4,
              greedy_head=greedy)
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    prompt = list(range(1000, 1016))
    llm.generate([prompt], params)  # captures the graphs
    rates = [llm.generate([prompt], params)[0].metrics["decode_tok_s"] for _ in range(reps)]
    del llm
    torch.cuda.empty_cache()
    return rates


def kernel_times() -> list[dict]:
    """The head GEMV alone: us per call per (tile, x dtype, PDL), checked against the reference."""
    from deltaserve.bench.gpu import graph_replay_s
    from deltaserve.ops.qgemv import qgemv_ref
    from deltaserve.quant.schemes import FORMATS

    scheme, dev, rows = FORMATS["int4"], torch.device("cuda"), []
    n, k = 248320, 1024
    copies = [{"weight": torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32,
                                       device=dev).view(torch.uint32),
               "scales": (torch.rand(n, k // 64, device=dev) * 1e-2).half(),
               "biases": (torch.randn(n, k // 64, device=dev) * 1e-2).half()} for _ in range(2)]
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(1, k, device=dev).to(dtype)
        ref = qgemv_ref(x.float(), copies[0], scheme)
        for tile, cfg in TILES.items():
            for pdl in (False, "tile"):
                out = triton_qgemv.qgemv_cuda(x, copies[0], scheme, config=cfg, pdl=pdl).float()
                err = ((out - ref).norm() / ref.norm()).item()
                us = graph_replay_s([lambda p=p, c=cfg, d=pdl, x=x: triton_qgemv.qgemv_cuda(
                    x, p, scheme, config=c, pdl=d) for p in copies]) * 1e6
                rows.append({"tile": tile, "x": str(dtype), "pdl": pdl, "us": us, "rel_err": err})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="a bf16 checkpoint; quantized to int4 here")
    ap.add_argument("--kernel", action="store_true", help="time the head GEMV alone instead")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting rounds after")
    args = ap.parse_args()
    if args.kernel:
        record = {"kind": "h200-head-kernel", "device": torch.cuda.get_device_name(),
                  "git_commit": os.environ.get("DELTASERVE_GIT_COMMIT"), "rows": kernel_times()}
        Path(args.out).write_text(json.dumps(record, indent=1))
        return
    if not args.model:
        ap.error("--model is needed unless --kernel")
    q = Path(tempfile.mkdtemp()) / "int4"
    quantize_checkpoint(Path(args.model), "int4", q)
    variants = [(t, pdl) for t in TILES for pdl in (True, False)]
    runs, start = [], time.time()
    for rnd in range(args.rounds):
        for tile, pdl in variants:
            if time.time() - start > args.budget_s:
                break
            set_variant(tile, pdl)
            row = {"round": rnd, "tile": tile, "head_pdl": pdl,
                   "sampling": decode_rates(q, False, args.reps),
                   "greedy": decode_rates(q, True, args.reps)}
            runs.append(row)
            print(json.dumps(row), flush=True)
    summary = {}
    for tile, pdl in variants:
        mine = [r for r in runs if r["tile"] == tile and r["head_pdl"] == pdl]
        if mine:
            summary[f"{tile} pdl={pdl}"] = {
                k: round(statistics.median(v for r in mine for v in r[k]), 1)
                for k in ("sampling", "greedy")}
    record = {"kind": "h200-head-probe", "git_commit": os.environ.get("DELTASERVE_GIT_COMMIT"),
              "device": torch.cuda.get_device_name(), "runs": runs, "median": summary}
    Path(args.out).write_text(json.dumps(record, indent=1))
    for name, med in summary.items():
        print(f"{name:>18}  sampling {med['sampling']:8.1f}  greedy {med['greedy']:8.1f}")


if __name__ == "__main__":
    main()
