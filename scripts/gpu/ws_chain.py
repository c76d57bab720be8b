"""Issue 4 experiment: the model's 96 int8 layer GEMVs as one warp-specialised persistent CUDA
kernel (scripts/gpu/ws_chain.cu: a producer warp streams every GEMV's weights through a ring of
shared-memory slots by bulk copies, never waiting on the grid; consumer warps wait at a grid
barrier per GEMV), against the engine's PDL chain of 96 Triton kernels on the same weights, in
the same run. Writes one JSON record.

    python3 scripts/gpu/ws_chain.py --out $OUT/ws-chain.json [--configs 10:8,6:8,10:4]

Needs CuPy (NVRTC) on the machine: this is a measurement, not an engine path. The chain is
persistent_chain.py's (qgemv_chain.py's model chain: 24 layers, 8224 / 5120 x 1024, 1024 x 2048,
7168 x 1024, 1024 x 3584; GEMV i reads row i of a buffer, writes row i + 1). Checked as there:
every step against dequantize-then-F.linear on its actual input, written rows poisoned first.
Configs: STAGES:consumer warps[:MODE[:V2[:POLL_NS]]].

Measured 2026-12-01 (BENCHMARKS.md, issue 4, "the 96 layer GEMVs as one persistent kernel"):
- V1 (counter barrier): 448-538 us against the PDL chain's 263-267. By MODE, the dot costs 1.8-2.6
  us per GEMV after the handoff, the fence 0.5-0.75 us, the barrier wait 0.3-0.5 us. The ring's
  streaming floor is 160.6 us (77.7% of copy).
- V2 (tagged words, a row per warp): 336-358 us with 16 warps; 225 us with no dot at all. Still
  27% slower than PDL.
"""

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from persistent_chain import (  # noqa: E402
    LAYERS,
    MATS,
    chain_setup,
    check,
    engine_result,
    finish,
    layer_n,
    new_record,
    run_variant,
    time_graph,
)

from deltaserve.quant.schemes import FORMATS  # noqa: E402

SRC = Path(__file__).with_name("ws_chain.cu")
X_MAX, MAX_ITEMS, SEG = 4096, 64, 512
# shared-memory bytes of one ring slot's codes and scales: V2 takes 8-row chunks of the
# 3584-wide down projection (28 KB), so that each of 8 warps has a row; 3 is V2 2 (pairs) with
# V1's 16 KB slots: more, smaller slots for the same shared memory
SLOT = {0: (16384, 1024), 1: (28672, 2048), 2: (28672, 2048), 3: (16384, 1024)}


class WSChain:
    """The kernel over `mats` (int8), reading / writing `bufs` [97, 1, width] as Chain does."""

    def __init__(self, mats: list[dict], bufs: torch.Tensor, stages: int, warps: int,
                 mode: int = 0, v2: int = 0, poll_ns: int = 0):
        import cupy as cp

        self.cp, self.scheme, self.bufs, self.warps = cp, FORMATS["int8"], bufs, warps
        codes, scales = SLOT[v2]
        opts = ("--std=c++17", f"-DNUM_STAGES={stages}", f"-DCW={warps}", f"-DMODE={mode}",
                f"-DV2={min(v2, 2)}", f"-DCODES_BYTES={codes}", f"-DSCALES_BYTES={scales}",
                f"-DPOLL_NS={poll_ns}")
        self.kern = cp.RawModule(code=SRC.read_text(), options=opts).get_function("ws_chain")
        self.smem = stages * (codes + scales) + 4 * X_MAX + 8 * MAX_ITEMS + 16 * stages
        self.kern.max_dynamic_shared_size_bytes = self.smem
        self.ctas = torch.cuda.get_device_properties(0).multi_processor_count
        self.counter = torch.zeros(2, dtype=torch.int32, device="cuda")
        self.epoch = torch.zeros(1, dtype=torch.int32, device="cuda")  # tags differ per launch
        self.ll = torch.zeros(bufs.shape[0], bufs.shape[-1], dtype=torch.int64, device="cuda")
        words = []
        for layer in range(LAYERS):
            for m, (_, k) in enumerate(MATS):
                i, n = 4 * layer + m, layer_n(m, layer)
                rows = min(16, codes // k)  # a chunk's rows: whole rows per warp in V2
                rows = rows // 8 * 8 if rows >= 8 else rows
                if k % SEG or k > X_MAX or rows * (k // 64) * 4 > scales:
                    raise ValueError(f"shape {n}x{k} does not fit the kernel's chunk layout")
                words += [mats[m]["weight"][layer].data_ptr(), mats[m]["scales"][layer].data_ptr(),
                          bufs[i, 0].data_ptr(), bufs[i + 1, 0].data_ptr(), n | (k << 32), rows]
        self.table = torch.tensor(words, dtype=torch.int64, device="cuda")
        self.num_phases = 4 * LAYERS

    def launch(self) -> None:
        self.counter.zero_()
        self.epoch.add_(1)
        cp = self.cp
        with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            self.kern((self.ctas,), ((self.warps + 1) * 32,),
                      (np.uint64(self.table.data_ptr()), np.int32(self.num_phases),
                       np.uint64(self.counter.data_ptr()), np.uint64(self.ll.data_ptr()),
                       np.int32(self.ll.shape[1]), np.uint64(self.epoch.data_ptr())),
                      shared_mem=self.smem)


def time_ws(run: WSChain, steps, copy_gbs: float, checked: bool = True) -> dict:
    graph, out = time_graph(run.launch, steps, copy_gbs)
    if int(run.counter[1].item()):
        raise RuntimeError("a bounded wait gave up")
    out["smem_bytes"] = run.smem
    if checked:
        out["max_rel_err"] = check(run, run.bufs, steps, graph)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", default="10:8,6:8:0:1,6:16:0:1,6:8:1:1,4:8:0:1",
                    help="STAGES:consumer warps[:MODE[:V2[:POLL_NS]]] (ws_chain.cu; MODE bits: "
                         "1 no dot, 2 no grid barrier wait, 4 no fence; those are timed, not "
                         "checked)")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    rec = new_record("h200-ws-gemv-chain")
    rec["variants"] = {}
    mats, bufs, steps, chain = chain_setup("int8")
    run_variant(rec, rec["variants"], "engine", lambda: engine_result(chain, rec["copy_gbs"]),
                args.out)
    for cfg in args.configs.split(","):
        stages, warps, mode, v2, ns = ([int(v) for v in cfg.split(":")] + [0] * 3)[:5]

        def one(stages=stages, warps=warps, mode=mode, v2=v2, ns=ns):
            res = time_ws(WSChain(mats, bufs, stages, warps, mode, v2, ns), steps,
                          rec["copy_gbs"], checked=mode == 0)
            return {**res, "stages": stages, "consumer_warps": warps, "mode": mode, "v2": v2,
                    "poll_ns": ns}

        run_variant(rec, rec["variants"], f"ws_{cfg.replace(':', '_')}", one, args.out)
    finish(rec, args.out)


if __name__ == "__main__":
    main()
