"""The quantized decode GEMV compiled for sm_90 without a GPU: SASS instruction counts per launch
config, to predict a kernel change before spending device time on it. Prints one JSON line each.

    python scripts/cpu/qgemv_sass.py [--bits 8] [--configs 16,1024,4,1,1 16,1024,4,1,2] [--pdl 2]

Triton compiles through its bundled ptxas; nvdisasm (also bundled) lists the SASS. Pointer and K
arguments get the 16-divisibility hints Triton's launcher gives the real ones (without them the
loads compile unvectorised and the counts mislead). Used on 2026-12-01: the int8 [16, 1024] tile
went from 1,432 to 1,224 instructions with MAGIC 2 (IADD3 225 -> 51), as the chain then measured.
"""

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from deltaserve.ops import triton_qgemv as tq  # noqa: E402

NVDISASM = Path(triton.__file__).parent / "backends/nvidia/bin/nvdisasm"
OPCODE = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", re.M)


def compile_gemv(bits: int, config: tuple, pdl: int, xmode: int = 0, x_dtype: str = "bf16"):
    block_n, block_k, warps, _, magic = config
    sig = {"W": "*i8" if bits == 8 else "*i32", "S": "*fp32", "B": "*fp32", "X": f"*{x_dtype}",
           "Y": f"*{x_dtype}", "YI": f"*{x_dtype}", "N": "i32", "K": "i32", "R": f"*{x_dtype}",
           "NW": f"*{x_dtype}", "TOTAL": f"*{x_dtype}", "eps": "fp32", "offset": "fp32"}
    const = {"G": 64, "BITS": bits, "HAS_BIAS": bits == 4, "BLOCK_N": block_n,
             "BLOCK_K": block_k, "MAGIC": magic, "ARGMAX": False, "PDL": pdl, "XMODE": xmode,
             "NORM_BLOCK": 16, "ONE_STEP": pdl >= 2}  # tile mode: BLOCK_K covers K
    names = tq._gemv_kernel.arg_names
    attrs = {(names.index(a),): [["tt.divisibility", 16]]
             for a in ("W", "S", "B", "X", "Y", "YI", "R", "NW", "TOTAL", "N", "K")}
    src = ASTSource(tq._gemv_kernel, sig, const, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def opcode_counts(kernel) -> collections.Counter:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([str(NVDISASM), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
    return collections.Counter(m.group(1).split(".")[0] for m in OPCODE.finditer(text))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bits", type=int, default=8, choices=(8, 4))
    ap.add_argument("--configs", nargs="+", default=["16,1024,4,1,1", "16,1024,4,1,2"],
                    help="BLOCK_N,BLOCK_K,warps,stages,MAGIC")
    ap.add_argument("--pdl", type=int, default=2, help="the kernel's PDL constexpr (2: tile)")
    ap.add_argument("--xmode", type=int, default=0, help="0 plain, 1 AddNorm, 2 SiluMul prologue")
    args = ap.parse_args()
    for text in args.configs:
        config = tuple(int(v) for v in text.split(","))
        counts = opcode_counts(compile_gemv(args.bits, config, args.pdl, args.xmode))
        print(json.dumps({"bits": args.bits, "config": config, "pdl": args.pdl,
                          "instructions": sum(counts.values()), "top": counts.most_common(10)}))


if __name__ == "__main__":
    main()
