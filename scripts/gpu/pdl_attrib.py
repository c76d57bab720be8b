"""Issue 4 attribution: where the engine's PDL chain of 96 layer GEMVs spends its time. Writes one
JSON record.

    python3 scripts/gpu/pdl_attrib.py --out $OUT/pdl-attrib.json [--formats int8,int4]

Why: the chain runs at 47-49% of copy bandwidth (int8; 2.73-2.78 us per GEMV against 1.31 us for
its bytes) and the 70% target allows 1.88 us. Each GEMV after its griddepcontrol.wait loads x,
converts its codes and multiplies (the dot), reduces, stores and completes; only then may the next
one pass its wait. Which of these costs what decides the next design: a cheaper dot (tensor cores)
pays only if the chain without a dot is well under 1.88 us per GEMV.

Variants, every one with the engine's grid (TUNED_PDL's launch shapes, whole-K tiles) and the same
pre-wait weight loads, on the same weights and buffer as the engine's chain:
  engine    the engine's kernel (ops/triton_qgemv, tile mode), checked against the reference;
  nodot     codes, scales and biases loaded before the wait as the engine does (codes as int32
            words), then consumed by an xor-reduction (~0.25 integer op per int8 code) instead of
            the conversion and multiply-adds; y = mean(x) + 1e-30 * that: the chain's data
            dependence is kept, the dot is gone;
  noweights no weight loads: the wait, x's load and mean, the store (boundary + x + store floor);
  empty     the wait and a store of a constant: the kernel boundary alone.
nodot / noweights / empty compute no GEMV, so they are timed, not checked.
"""

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from persistent_chain import (  # noqa: E402
    chain_setup,
    engine_result,
    finish,
    new_record,
    run_variant,
    time_graph,
)

from deltaserve.ops import triton_qgemv as tq  # noqa: E402
from deltaserve.ops.backend import gdc_launch_dependents, gdc_wait  # noqa: E402
from deltaserve.quant.schemes import FORMATS  # noqa: E402

WORK = {"nodot": 1, "noweights": 2, "empty": 3}


@triton.jit
def _attrib_kernel(W, S, B, X, Y, N, K, NUM_WORDS, NUM_GROUPS, HAS_BIAS: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_G: tl.constexpr,
                   BLOCK_K: tl.constexpr, WORK: tl.constexpr):
    """One program: BLOCK_N rows. WORK 1 nodot, 2 noweights, 3 empty (module docstring)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    if WORK == 1:  # the static operands, before the wait, as the engine's tile mode loads them
        wc = tl.arange(0, BLOCK_W)
        q = tl.load(W + rows[:, None] * NUM_WORDS + wc[None, :],
                    mask=row_ok[:, None] & (wc < NUM_WORDS)[None, :], other=0)
        gc = tl.arange(0, BLOCK_G)
        g_off = rows[:, None] * NUM_GROUPS + gc[None, :]
        g_ok = row_ok[:, None] & (gc < NUM_GROUPS)[None, :]
        s = tl.load(S + g_off, mask=g_ok, other=0.0).to(tl.float32)
        if HAS_BIAS:
            s += tl.load(B + g_off, mask=g_ok, other=0.0).to(tl.float32)
    gdc_wait()
    gdc_launch_dependents()
    y = tl.zeros([BLOCK_N], dtype=tl.float32)
    if WORK <= 2:
        cols = tl.arange(0, BLOCK_K)
        x = tl.load(X + cols, mask=cols < K, other=0.0).to(tl.float32)
        y += tl.sum(x, 0) / K
    if WORK == 1:
        h = tl.xor_sum(q, axis=1)
        y += (h & 0xFFFF).to(tl.float32) * 1e-30 + tl.sum(s, axis=1) * 1e-30
    tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=row_ok)


class Attrib:
    """The chain's 96 steps launched with _attrib_kernel in one WORK mode."""

    def __init__(self, fmt: str, bufs: torch.Tensor, steps, work: int):
        self.scheme, self.bufs, self.steps, self.work = FORMATS[fmt], bufs, steps, work

    def launch(self) -> None:
        s = self.scheme
        for i, (p, n, k) in enumerate(self.steps):
            cfg = tq.whole_k_config(tq.config_for(s.bits, n, k, tq.TUNED_PDL), s.bits, k)
            block_n, _, warps, _, _ = cfg
            words = p["weight"].view(torch.int32)
            num_words, num_groups = words.shape[-1], p["scales"].shape[-1]
            _attrib_kernel[(triton.cdiv(n, block_n),)](
                words, p["scales"], p.get("biases", p["scales"]), self.bufs[i, :, :k],
                self.bufs[i + 1, :, :n], n, k, num_words, num_groups,
                HAS_BIAS=s.has_biases(), BLOCK_N=block_n,
                BLOCK_W=triton.next_power_of_2(num_words),
                BLOCK_G=triton.next_power_of_2(num_groups),
                BLOCK_K=triton.next_power_of_2(k), WORK=self.work, num_warps=warps,
                launch_pdl=True)


def run_format(rec: dict, fmt: str, out: str) -> None:
    _, bufs, steps, chain = chain_setup(fmt)
    sink = rec["formats"].setdefault(fmt, {"variants": {}})["variants"]
    run_variant(rec, sink, "engine", lambda: engine_result(chain, rec["copy_gbs"]), out, f"{fmt}/")
    for name, work in WORK.items():
        def one(work=work):
            _, res = time_graph(Attrib(fmt, bufs, steps, work).launch, steps, rec["copy_gbs"])
            return res
        run_variant(rec, sink, name, one, out, f"{fmt}/")
    run_variant(rec, sink, "engine_repeat", lambda: engine_result(chain, rec["copy_gbs"]), out,
                f"{fmt}/")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--formats", default="int8,int4")
    args = ap.parse_args()
    rec = new_record("h200-pdl-chain-attribution")
    rec["formats"] = {}
    for fmt in args.formats.split(","):
        run_format(rec, fmt, args.out)
        torch.cuda.empty_cache()
    finish(rec, args.out)


if __name__ == "__main__":
    main()
