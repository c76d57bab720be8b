"""H200 check + timing of the Triton quantized GEMVs on Qwen3.5-0.8B decode shapes; writes JSON.

    python scripts/gpu/qgemv_bench.py --out $OUT/qgemv.json

Per shape and format: rel error against dequantize-then-F.linear (fp32), time per call (CUDA
events, CUDA-graph replay of 20 calls, median of 20; eager time too), effective bandwidth of the bytes read (codes + scales + biases + x), beside
the device copy bandwidth measured in the same run (clone of 2 GiB: read + write) and bf16 F.linear.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from deltaserve.ops.qgemv import qgemv_ref  # noqa: E402
from deltaserve.ops.triton_qgemv import qgemv_cuda  # noqa: E402
from deltaserve.quant.schemes import FORMATS, quantize  # noqa: E402

SHAPES = [(6144, 1024), (2048, 1024), (7168, 1024), (1024, 3584), (248320, 1024)]


def graphed(fn, calls=20):
    """Time per call with the calls replayed from a CUDA graph: kernel time without Python's
    launch overhead (what decode under CUDA graphs sees)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return timed(g.replay, 20) / calls


def timed(fn, reps=50):
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    big = torch.empty(2**30, dtype=torch.int16, device=dev)
    copy_s = timed(lambda: big.clone(), 10)
    copy_gbs = 2 * big.numel() * 2 / copy_s / 1e9
    del big
    rows = []
    for n, k in SHAPES:
        w = torch.randn(n, k, device=dev) * 0.05
        x = torch.randn(1, k, device=dev)
        wb = w.bfloat16()
        xb = x.bfloat16()
        bf16_s = graphed(lambda: F.linear(xb, wb))
        for fmt in ("int8", "int4"):
            s = FORMATS[fmt]
            p = {kk: (v.float() if v.is_floating_point() else v).to(dev)
                 for kk, v in quantize(w, s).items()}
            out, ref = qgemv_cuda(x, p, s), qgemv_ref(x, p, s)
            err = ((out - ref).norm() / ref.norm()).item()
            by_block = {bn: graphed(lambda bn=bn: qgemv_cuda(x, p, s, block_n=bn)) for bn in (4, 8, 32, 128)}
            best_bn = min(by_block, key=by_block.get)
            sec = by_block[best_bn]
            eager_s = timed(lambda: qgemv_cuda(x, p, s, block_n=best_bn))
            nbytes = sum(v.numel() * v.element_size() for v in p.values()) + x.numel() * 4
            rows.append({"shape": [n, k], "format": fmt, "rel_err": err, "us": sec * 1e6,
                         "gbs": nbytes / sec / 1e9, "frac_of_copy": nbytes / sec / 1e9 / copy_gbs,
                         "bf16_linear_us": bf16_s * 1e6, "block_n": best_bn, "eager_us": eager_s * 1e6,
                         "bf16_gbs": wb.numel() * 2 / bf16_s / 1e9})
            print(json.dumps(rows[-1]), flush=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    record = {"kind": "h200-qgemv", "git_commit": commit.strip(), "device":
              torch.cuda.get_device_name(), "torch": torch.__version__, "copy_gbs": copy_gbs,
              "note": "scales/biases fp32 in memory", "rows": rows}
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(json.dumps({"copy_gbs": copy_gbs}))


if __name__ == "__main__":
    main()
