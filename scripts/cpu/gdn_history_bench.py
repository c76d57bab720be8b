"""Dense GDN decode state vs the compact history form, one decode step at batch B (CPU).

    python scripts/cpu/gdn_history_bench.py --out gdn_history.json

Qwen3.5-0.8B's GDN heads (16 value heads, K = V = 128), 2 threads. Times per step of one layer:
torch dense step (ops/gdn.gdn_step), the native fused dense step (ds_gdn_decode through
ops/gdn_decode, conv + norms included), and the torch history step at history lengths T.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from deltaserve.ops.gdn import gdn_step  # noqa: E402
from deltaserve.ops.gdn_decode import gdn_decode  # noqa: E402
from deltaserve.ops.gdn_history import History, gdn_step_history  # noqa: E402

HEADS, DIM = 16, 128


def timed(fn, reps=10) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(bsz: int) -> dict:
    q, k = torch.randn(bsz, HEADS, DIM), torch.randn(bsz, HEADS, DIM)
    v, g, beta = torch.randn(bsz, HEADS, DIM), -torch.rand(bsz, HEADS), torch.rand(bsz, HEADS)
    state = torch.zeros(bsz, HEADS, DIM, DIM)
    row = {"batch": bsz,
           "dense_torch_ms": timed(lambda: gdn_step(q, k, v, g, beta, state, qk_l2norm=True)) * 1e3}
    conv = HEADS * DIM * 3
    qkv, z = torch.randn(bsz, conv), torch.randn(bsz, HEADS * DIM)
    window, conv_w = torch.zeros(bsz, conv, 3), torch.randn(conv, 4)
    a_log, dt_bias, norm_w = torch.zeros(HEADS), torch.zeros(HEADS), torch.ones(DIM)
    row["dense_native_ms"] = timed(lambda: gdn_decode(
        qkv, z, beta, beta, window, conv_w, a_log, dt_bias, state, norm_w, 1e-6, HEADS)) * 1e3
    for length in (8, 16, 32, 64):
        hist = History.empty(bsz, HEADS, DIM, DIM, capacity=length + 16)
        for _ in range(length):
            gdn_step_history(q, k, v, g, beta, hist)

        def step(hist=hist, length=length):
            hist.length = length  # the same history length every repeat
            gdn_step_history(q, k, v, g, beta, hist)

        row[f"history_T{length}_ms"] = timed(step) * 1e3
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(2)
    torch.set_flush_denormal(True)  # decays underflow; the native kernel flushes them too
    rows = []
    for bsz in (8, 32, 128):
        rows.append(measure(bsz))
        print(json.dumps(rows[-1]), flush=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    Path(args.out).write_text(json.dumps({"git_commit": commit.strip(), "torch": torch.__version__,
                                          "threads": 2, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
