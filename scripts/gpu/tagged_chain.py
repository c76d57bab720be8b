"""Issue 4 experiment: the engine's chain of 96 int8 GEMV kernels under programmatic dependent
launch (PDL), with the handoff between them as tagged words instead of griddepcontrol.wait.
Against the engine's PDL chain on the same weights, in the same run. Writes one JSON record.

    python3 scripts/gpu/tagged_chain.py --out $OUT/tagged-chain.json

Why: a GEMV under PDL loads its weights, then waits (griddepcontrol.wait) until its predecessor
grid has completed and flushed; ~1.2 us per boundary (BENCHMARKS.md, issue 4). In the persistent
kernel (ws_chain.cu V2), the same handoff as tagged words (each y value stored with its step's
tag in one 8-byte word, as NCCL's LL protocol does; the reader polls the words it needs, no fence)
cost 0.67 us per GEMV over the stream. Here each GEMV:
  - releases its dependent at once (gdc_launch_dependents first): the next GEMV's programs start
    as soon as all of this one's have, which PDL guarantees are resident, so polling cannot starve
    the predecessor;
  - loads its whole [BLOCK_N, K] weight tile;
  - polls its x words until each carries this step's tag (a volatile load, bypassing L1);
  - stores y with the next step's tag.
The first GEMV waits for the step's prologue (which advances the epoch and tags x0) the usual
way, and releases its dependent only after that wait, so every later GEMV reads the new epoch.
Tags = epoch * 256 + step: a replay never accepts the previous replay's words.

Only valid where each kernel reads nothing but its predecessor's output (true of this chain, not
of a decode step, whose norms and residuals would need tags too). int8, TUNED_PDL's launch shapes.
Checked: every step against dequantize-then-F.linear on its actual input, after poisoning.

Measured 2026-12-01 (BENCHMARKS.md, issue 4): 394-428 us against the PDL chain's 263, a loss.
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
    LAYERS,
    MATS,
    chain_setup,
    engine_result,
    finish,
    layer_n,
    new_record,
    run_variant,
    time_graph,
)
from qgemv_chain import rel  # noqa: E402

from deltaserve.ops import triton_qgemv as tq  # noqa: E402
from deltaserve.ops.backend import gdc_launch_dependents, gdc_wait  # noqa: E402
from deltaserve.ops.qgemv import qgemv_ref  # noqa: E402
from deltaserve.quant.schemes import FORMATS  # noqa: E402

SPIN_LIMIT = tl.constexpr(200_000)


@triton.jit
def _tagged_gemv(W, S, XT, YT, E, FLAG, N, K, step, G: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, MAGIC: tl.constexpr, FIRST: tl.constexpr,
                 SLEEP_NS: tl.constexpr):
    """y = W x for int8 W, x and y as tagged words (high 32 bits the tag, low the fp32 bits)."""
    pid = tl.program_id(0)
    if not FIRST:
        gdc_launch_dependents()
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    q, s, _ = tq._weights(W, S, S, rows, row_ok, 0, K, K // G, G, 8, False, BLOCK_K)
    if FIRST:
        gdc_wait()  # the prologue (epoch, tagged x0) is complete
        gdc_launch_dependents()
    tag = tl.load(E) * 256 + step
    cols = tl.arange(0, BLOCK_K)
    ok = cols < K
    words = tl.load(XT + cols, mask=ok, other=0, volatile=True)
    tries = 0
    while (tl.sum(((words >> 32).to(tl.int32) != tag) & ok) > 0) & (tries < SPIN_LIMIT):
        if SLEEP_NS > 0:  # back off: a spinning program takes issue slots and L2 from the producer
            tries = tl.inline_asm_elementwise(f"nanosleep.u32 {SLEEP_NS}; mov.b32 $0, $1;", "=r,r",
                                              [tries], dtype=tl.int32, is_pure=False, pack=1)
        words = tl.load(XT + cols, mask=ok, other=0, volatile=True)
        tries += 1
    if tries >= SPIN_LIMIT:
        tl.atomic_xchg(FLAG, 1)
    x = (words & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
    x = tl.where(ok, x, 0.0)
    NG: tl.constexpr = BLOCK_K // G
    part = tl.sum(tl.reshape(tq._to_float(q, 8, MAGIC) * x[None, :], (BLOCK_N, NG, G)), axis=2)
    y = tl.sum(part * s, axis=1)
    out = ((tag + 1).to(tl.int64) << 32) | (y.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF)
    tl.store(YT + rows, out, mask=row_ok)


@triton.jit
def _prologue(E, XT, X0, K, BLOCK: tl.constexpr):
    """epoch += 1; x0 tagged with step 0 of the new epoch (one program)."""
    epoch = tl.load(E) + 1
    tl.store(E, epoch)
    cols = tl.arange(0, BLOCK)
    ok = cols < K
    x = tl.load(X0 + cols, mask=ok, other=0.0)
    word = ((epoch * 256).to(tl.int64) << 32) | (x.to(tl.int32, bitcast=True).to(tl.int64)
                                                  & 0xFFFFFFFF)
    tl.store(XT + cols, word, mask=ok)


class TaggedChain:
    """The chain over `mats` with tagged buffers; `plain` [97, 1, width] fp32 holds x0 (row 0)."""

    def __init__(self, mats: list[dict], plain: torch.Tensor, table: dict, sleep_ns: int = 0):
        self.mats, self.plain, self.scheme = mats, plain, FORMATS["int8"]
        self.tagged = torch.zeros(plain.shape[0], plain.shape[-1], dtype=torch.int64,
                                  device="cuda")
        self.epoch = torch.zeros(1, dtype=torch.int32, device="cuda")
        self.flag = torch.zeros(1, dtype=torch.int32, device="cuda")
        self.table, self.sleep_ns = table, sleep_ns

    def launch(self) -> None:
        k0 = MATS[0][1]
        _prologue[(1,)](self.epoch, self.tagged[0], self.plain[0, 0], k0,
                        BLOCK=triton.next_power_of_2(k0))
        for i in range(4 * LAYERS):
            layer, m = divmod(i, 4)
            n, k = layer_n(m, layer), MATS[m][1]
            cfg = tq.whole_k_config(tq.config_for(8, n, k, self.table), 8, k)
            block_n, block_k, warps, _, magic = cfg
            _tagged_gemv[(triton.cdiv(n, block_n),)](
                self.mats[m]["weight"][layer], self.mats[m]["scales"][layer], self.tagged[i],
                self.tagged[i + 1], self.epoch, self.flag, n, k, i, G=64, BLOCK_N=block_n,
                BLOCK_K=block_k, MAGIC=magic, FIRST=i == 0, SLEEP_NS=self.sleep_ns,
                num_warps=warps, launch_pdl=True)

    def outputs(self) -> torch.Tensor:
        """The tagged rows' values as fp32 [97, width] (tags stripped)."""
        return (self.tagged & 0xFFFFFFFF).to(torch.int32).view(torch.float32)


def time_tagged(run: TaggedChain, steps, copy_gbs: float) -> dict:
    graph, out = time_graph(run.launch, steps, copy_gbs)
    run.tagged[1:].fill_(-1)  # poison: tag -1 never matches, value NaN
    run.flag.zero_()
    graph.replay()
    torch.cuda.synchronize()
    if int(run.flag.item()):
        raise RuntimeError("a tag poll gave up")
    vals = run.outputs()
    err = 0.0
    for i, (p, n, k) in enumerate(steps):
        x = (run.plain[0, :, :k] if i == 0 else vals[i, :k].unsqueeze(0))
        err = max(err, rel(vals[i + 1, :n].unsqueeze(0), qgemv_ref(x, p, run.scheme)))
    out["max_rel_err"] = err
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    rec = new_record("h200-tagged-pdl-gemv-chain")
    rec["variants"] = {}
    mats, plain, steps, chain = chain_setup("int8")
    todo = [("engine", None, 0), ("tagged", tq.TUNED_PDL, 0), ("tagged_tuned", tq.TUNED, 0),
            ("tagged_sleep100", tq.TUNED_PDL, 100),
            ("tagged_sleep500", tq.TUNED_PDL, 500), ("tagged_sleep2000", tq.TUNED_PDL, 2000),
            ("engine", None, 0)]
    for key, table, sleep_ns in todo:
        key = key if key not in rec["variants"] else f"{key}_repeat"
        if table is None:
            fn = lambda: engine_result(chain, rec["copy_gbs"])  # noqa: E731
        else:
            fn = lambda t=table, ns=sleep_ns: time_tagged(  # noqa: E731
                TaggedChain(mats, plain, t, ns), steps, rec["copy_gbs"])
        run_variant(rec, rec["variants"], key, fn, args.out)
    finish(rec, args.out)


if __name__ == "__main__":
    main()
