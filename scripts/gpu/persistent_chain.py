"""Issue 4 experiment: the model's chain of 96 layer GEMVs as ONE persistent kernel with grid
barriers, each program holding the next GEMV's weight tile in registers while it waits; against
the engine's PDL chain of 96 kernels on the same weights, in the same run. Writes one JSON record.

    python3 scripts/gpu/persistent_chain.py --out $OUT/persistent-chain.json

Why (BENCHMARKS.md, issue 4, 2c/2d): every kernel boundary costs ~1.2 us even without a data
dependence, and a software grid barrier alone costs 0.7-1.1 us, so neither PDL nor a plain
persistent kernel reaches 70% of copy bandwidth on 0.5-2 us GEMVs. What a persistent kernel can
do that a chain of kernels cannot: issue GEMV i+1's weight loads (static, no dependence) before
it waits at barrier i, so DRAM streams while the barrier and x's round trip resolve.

Each program owns one row tile of every GEMV (BLOCK_N rows, all of K): programs >= tiles of
every phase, all resident at once (one or two per SM; a grid that could not be resident would
not finish: each spin gives up after 20,000 polls and flags it; so the grid is the SM count
times PER_SM, registers capped to fit). Phase p (GEMV p) of a program: issue the loads
of phase p+1's tile; wait until every program has arrived at barrier p-1 (x_p written); load x_p,
dot it with phase p's tile (loaded one phase earlier), store y_p; a CTA barrier, then arrive
(release). The chain is the one qgemv_chain.py's model chain runs: 24 layers, in_proj 8224 (every
4th layer qkv 5120) x 1024, out_proj 1024 x 2048, gate_up 7168 x 1024, down 1024 x 3584; GEMV i
reads row i of a buffer and writes row i + 1.

Variants: PREFETCH 1 (the next tile before the barrier), 2 (its first K half only: fewer
registers), 0 (each tile loaded after its barrier); PER_SM 1 / 2; warps; registers capped so
that PER_SM programs fit on an SM (maxnreg). Checked: every step against dequantize-then-
F.linear on its actual input, the written rows poisoned with NaN before the replay checked.

Measured 2026-12-01 (BENCHMARKS.md, issue 4, "the 96 layer GEMVs as one persistent kernel"):
slower than the PDL chain in every variant (int8 366-625 us against 266; int4 790-1,158 against
329). PREFETCH 1 spills at the 128-register cap, and the dot of a 64 KB tile runs after the
barrier, unoverlapped.
"""

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from qgemv_chain import Chain, git_commit, nbytes, packed_gpu, rel, time_chain  # noqa: E402

from deltaserve.bench.gpu import copy_bandwidth_gbs, cuda_median_s, gpu_state  # noqa: E402
from deltaserve.ops import triton_qgemv as tq  # noqa: E402
from deltaserve.ops.qgemv import qgemv_ref  # noqa: E402
from deltaserve.quant.schemes import FORMATS  # noqa: E402

LAYERS, N_GDN, N_ATTN, HID, VDIM, INTER = 24, 8224, 5120, 1024, 2048, 3584


@triton.jit
def _half(W, S, B, layer, n, pid, k0, K: tl.constexpr, N_STRIDE: tl.constexpr, G: tl.constexpr,
          BITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr):
    """Half k0 (0 or BLOCK_K / 2) of this program's [BLOCK_N, K] tile of layer `layer`'s matrix
    (N_STRIDE rows stored per layer, the first n used): codes, scales, biases. Static: loadable
    before any barrier. Halves, each converted on its own, keep the conversion's registers to half
    a tile's (a whole [64, 1024] int8 tile plus the next one's spilled at 128 registers)."""
    PER: tl.constexpr = 1 if BITS == 8 else 32 // BITS
    NG: tl.constexpr = K // G
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    base = layer.to(tl.int64) * N_STRIDE
    return tq._weights(W + base * (K // PER), S + base * NG, B + base * NG, rows, rows < n, k0, K,
                       NG, G, BITS, HAS_BIAS, BLOCK_K // 2)


@triton.jit
def _wait(C, target):
    """Until every program has arrived `target` times in total (acquire: x then visible). A
    bounded spin: past ~20k polls it sets C[1] and goes on (a wrong result, flagged, rather than a
    hung device)."""
    seen = tl.atomic_add(C, 0, sem="acquire", scope="gpu")
    tries = 0
    while (seen < target) & (tries < 20_000):
        seen = tl.atomic_add(C, 0, sem="acquire", scope="gpu")
        tries += 1
    if seen < target:
        tl.atomic_xchg(C + 1, 1)


@triton.jit
def _phase(cur_a, cur_b, Wc, Sc, Bc, layer_c, n_c, Wn, Sn, Bn, layer_n, n_n, X, Y, C, target,
           pid, G: tl.constexpr, BITS: tl.constexpr, HAS_BIAS: tl.constexpr, MAGIC: tl.constexpr,
           PREFETCH: tl.constexpr, Kc: tl.constexpr, NSc: tl.constexpr, BNc: tl.constexpr,
           BKc: tl.constexpr, Kn: tl.constexpr, NSn: tl.constexpr, BNn: tl.constexpr,
           BKn: tl.constexpr):
    """One GEMV of the chain. Before the barrier: the next GEMV's tile (PREFETCH 1), its first
    half (2), nothing (0). After it: whatever of this GEMV's tile is not in registers yet, x,
    the dot, y stored, arrive. Returns the next GEMV's (first half, second half) as loaded."""
    if PREFETCH >= 1:
        next_a = _half(Wn, Sn, Bn, layer_n, n_n, pid, 0, Kn, NSn, G, BITS, HAS_BIAS, BNn, BKn)
    if PREFETCH == 1:
        next_b = _half(Wn, Sn, Bn, layer_n, n_n, pid, BKn // 2, Kn, NSn, G, BITS, HAS_BIAS, BNn,
                       BKn)
    _wait(C, target)
    if PREFETCH == 0:
        cur_a = _half(Wc, Sc, Bc, layer_c, n_c, pid, 0, Kc, NSc, G, BITS, HAS_BIAS, BNc, BKc)
    if PREFETCH != 1:
        cur_b = _half(Wc, Sc, Bc, layer_c, n_c, pid, BKc // 2, Kc, NSc, G, BITS, HAS_BIAS, BNc,
                      BKc)
    HALF: tl.constexpr = BKc // 2
    qa, sa, ba = cur_a
    qb, sb, bb = cur_b
    acc = tl.zeros([BNc, HALF // G], dtype=tl.float32)
    acc = tq._step(acc, qa, sa, ba, X, X, X, 1.0, 0.0, 0, Kc, G, BITS, HAS_BIAS, BNc, HALF,
                   MAGIC, 0)
    acc = tq._step(acc, qb, sb, bb, X, X, X, 1.0, 0.0, HALF, Kc, G, BITS, HAS_BIAS, BNc, HALF,
                   MAGIC, 0)
    rows = pid * BNc + tl.arange(0, BNc)
    tl.store(Y + rows, tl.sum(acc, axis=1), mask=rows < n_c)
    tl.debug_barrier()  # every thread's stores precede the release below
    tl.atomic_add(C, 1, sem="release", scope="gpu")
    if PREFETCH == 0:
        next_a = cur_a  # placeholders: the next phase loads its own tile
    if PREFETCH != 1:
        next_b = cur_b
    return next_a, next_b


@triton.jit
def _chain_kernel(W0, S0, B0, W1, S1, B1, W2, S2, B2, W3, S3, B3, BUF, C, row_stride,
                  num_layers, G: tl.constexpr, BITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                  MAGIC: tl.constexpr, PREFETCH: tl.constexpr,
                  N0: tl.constexpr, N0_ALT: tl.constexpr, N1: tl.constexpr, N2: tl.constexpr,
                  N3: tl.constexpr, K0: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr,
                  K3: tl.constexpr, BN0: tl.constexpr, BN1: tl.constexpr, BN2: tl.constexpr,
                  BN3: tl.constexpr, BK0: tl.constexpr, BK1: tl.constexpr, BK2: tl.constexpr,
                  BK3: tl.constexpr):
    """Per layer four GEMVs (matrices 0..3); matrix 0 has N0 rows, N0_ALT every 4th layer. The
    tiles of phase 0 are loop-carried: the last phase of a layer loads the next layer's."""
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    zero = pid * 0
    a0 = _half(W0, S0, B0, zero, N0, pid, 0, K0, N0, G, BITS, HAS_BIAS, BN0, BK0)
    b0 = _half(W0, S0, B0, zero, N0, pid, BK0 // 2, K0, N0, G, BITS, HAS_BIAS, BN0, BK0)
    for layer in range(num_layers):
        ph = 4 * layer
        n0 = N0_ALT if layer % 4 == 3 else N0
        nxt = layer + 1
        n_next = tl.where(nxt < num_layers, tl.where(nxt % 4 == 3, N0_ALT, N0), 0)
        nxt = tl.minimum(nxt, num_layers - 1)  # past the last layer: its rows masked (n_next 0)
        x = BUF + ph.to(tl.int64) * row_stride
        a1, b1 = _phase(a0, b0, W0, S0, B0, layer, n0, W1, S1, B1, layer, N1, x, x + row_stride,
                        C, progs * ph, pid, G, BITS, HAS_BIAS, MAGIC, PREFETCH, K0, N0, BN0, BK0,
                        K1, N1, BN1, BK1)
        x += row_stride
        a2, b2 = _phase(a1, b1, W1, S1, B1, layer, N1, W2, S2, B2, layer, N2, x, x + row_stride,
                        C, progs * (ph + 1), pid, G, BITS, HAS_BIAS, MAGIC, PREFETCH, K1, N1, BN1,
                        BK1, K2, N2, BN2, BK2)
        x += row_stride
        a3, b3 = _phase(a2, b2, W2, S2, B2, layer, N2, W3, S3, B3, layer, N3, x, x + row_stride,
                        C, progs * (ph + 2), pid, G, BITS, HAS_BIAS, MAGIC, PREFETCH, K2, N2, BN2,
                        BK2, K3, N3, BN3, BK3)
        x += row_stride
        n0_, n1_ = _phase(a3, b3, W3, S3, B3, layer, N3, W0, S0, B0, nxt, n_next, x,
                        x + row_stride, C, progs * (ph + 3), pid, G, BITS, HAS_BIAS, MAGIC,
                        PREFETCH, K3, N3, BN3, BK3, K0, N0, BN0, BK0)
        if PREFETCH >= 1:  # the next layer's first tile (first half for 2), loop-carried
            a0 = n0_
        if PREFETCH == 1:
            b0 = n1_


MATS = [(N_GDN, HID), (HID, VDIM), (2 * INTER, HID), (HID, INTER)]


def stacked(fmt: str, seed: int) -> list[dict]:
    """Per matrix kind, every layer's packed weight stacked [L, N, ...] (L2-cold: 24 x 21 MB)."""
    out = []
    for m, (n, k) in enumerate(MATS):
        parts = [packed_gpu(fmt, n, k, seed=seed + 100 * m + layer) for layer in range(LAYERS)]
        out.append({key: torch.stack([p[key] for p in parts]) for key in parts[0]})
    return out


def layer_n(m: int, layer: int) -> int:
    return (N_ATTN if layer % 4 == 3 else N_GDN) if m == 0 else MATS[m][0]


def steps_of(mats: list[dict]) -> list[tuple[dict, int, int]]:
    """(packed views, N, K) per GEMV in chain order: what the reference and Chain read."""
    return [({key: v[layer, :layer_n(m, layer)] for key, v in mats[m].items()},
             layer_n(m, layer), MATS[m][1]) for layer in range(LAYERS) for m in range(4)]


def chain_setup(fmt: str):
    """The chain's stacked weights, its buffer [97, 1, width] (row 0 the first x), its steps, and
    the engine's PDL chain (qgemv_chain.Chain) over the same weights and buffer."""
    mats = stacked(fmt, seed=11)
    width = max(max(n, k) for n, k in MATS)
    bufs = torch.randn(4 * LAYERS + 1, 1, width, device="cuda")
    steps = steps_of(mats)
    chain = Chain(fmt, [(f"s{i}", p, n, k) for i, (p, n, k) in enumerate(steps)])
    chain.bufs = bufs
    return mats, bufs, steps, chain


def engine_result(chain, copy_gbs: float) -> dict:
    """The engine's PDL chain (TUNED_PDL, tile mode) timed and checked by qgemv_chain."""
    res = time_chain(chain, "engine", copy_gbs)
    res.pop("final")
    return res


def time_graph(launch, steps, copy_gbs: float):
    """launch() once (compiles), captured into a CUDA graph and timed: (graph, the record's
    figures). The caller checks through the graph, then drops it."""
    launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    sec = cuda_median_s(graph.replay, 50)
    total = sum(nbytes(p, k) for p, _, k in steps)
    gbs = total / sec / 1e9
    return graph, {"chain_us": sec * 1e6, "us_per_gemv": sec * 1e6 / len(steps), "bytes": total,
                   "gbs": gbs, "pct_of_copy": 100 * gbs / copy_gbs}


def new_record(kind: str) -> dict:
    """A run record: commit, device, versions, GPU state, and the copy bandwidth (printed)."""
    rec = {"kind": kind, "git_commit": git_commit(), "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "triton": triton.__version__, "gpu_before": gpu_state(),
           "errors": []}
    rec["copy_gbs"] = copy_bandwidth_gbs(torch.device("cuda"))
    print(json.dumps({"copy_gbs": rec["copy_gbs"]}), flush=True)
    return rec


def run_variant(rec: dict, sink: dict, key: str, fn, out: str, where: str = "") -> None:
    """sink[key] = fn(), printed; a failure is recorded in rec["errors"] and the run goes on; the
    record is saved either way (a killed run keeps what it measured)."""
    try:
        sink[key] = fn()
        print(json.dumps({"variant": f"{where}{key}", **sink[key]}), flush=True)
    except Exception as exc:
        rec["errors"].append({"where": f"{where}{key}", "error": repr(exc)[:400],
                              "trace": traceback.format_exc()[-1500:]})
        print(json.dumps(rec["errors"][-1]), flush=True)
    Path(out).write_text(json.dumps(rec))


def finish(rec: dict, out: str) -> None:
    rec["gpu_after"] = gpu_state()
    Path(out).write_text(json.dumps(rec))
    print(json.dumps({"errors": len(rec["errors"])}))


class Persistent:
    """The persistent chain over `mats`, reading / writing `bufs` [97, 1, width] as Chain does."""

    def __init__(self, fmt: str, mats: list[dict], bufs: torch.Tensor, per_sm: int, warps: int,
                 prefetch: int):
        self.scheme, self.mats, self.bufs = FORMATS[fmt], mats, bufs
        self.progs = torch.cuda.get_device_properties(0).multi_processor_count * per_sm
        self.warps, self.prefetch = warps, prefetch
        # every program resident at once, or the barrier's spins give up: cap registers to fit PER_SM
        self.maxnreg = min(255, 65536 // (32 * warps * per_sm)) // 8 * 8
        self.counter = torch.zeros(2, dtype=torch.int32, device="cuda")
        self.blocks = [triton.next_power_of_2(triton.cdiv(n, self.progs)) for n, _ in MATS]
        for (n, _), bn in zip(MATS, self.blocks, strict=True):
            if triton.cdiv(n, bn) > self.progs:
                raise ValueError(f"{n} rows in tiles of {bn} need more than {self.progs} programs")

    def launch(self) -> None:
        self.counter.zero_()
        s = self.scheme
        args = []
        for p in self.mats:
            w = p["weight"] if s.kind == "int8" else p["weight"].view(torch.int32)
            args += [w, p["scales"], p.get("biases", p["scales"])]
        consts = {f"N{m}": n for m, (n, _) in enumerate(MATS)}
        consts.update({f"K{m}": k for m, (_, k) in enumerate(MATS)})
        consts.update({f"BN{m}": bn for m, bn in enumerate(self.blocks)})
        consts.update({f"BK{m}": triton.next_power_of_2(k) for m, (_, k) in enumerate(MATS)})
        magic = 2
        _chain_kernel[(self.progs,)](
            *args, self.bufs, self.counter, self.bufs.stride(0), LAYERS, G=s.group_size,
            BITS=s.bits, HAS_BIAS=s.has_biases(), MAGIC=magic, PREFETCH=self.prefetch,
            N0_ALT=N_ATTN, **consts, num_warps=self.warps, maxnreg=self.maxnreg)


def check(run, bufs: torch.Tensor, steps, graph) -> float:
    for i, (_, n, _) in enumerate(steps):
        bufs[i + 1, :, :n].fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    if int(run.counter[1].item()):
        raise RuntimeError("a grid barrier's spin gave up: programs were not all resident")
    return max(rel(bufs[i + 1, :, :n], qgemv_ref(bufs[i, :, :k], p, run.scheme))
               for i, (p, n, k) in enumerate(steps))


def time_persistent(run: Persistent, steps, copy_gbs: float) -> dict:
    graph, out = time_graph(run.launch, steps, copy_gbs)
    out["max_rel_err"] = check(run, run.bufs, steps, graph)
    return out


def run_format(rec: dict, fmt: str, configs: list[str], out: str) -> None:
    """The engine's chain, then each persistent config, on one format's weights."""
    mats, bufs, steps, chain = chain_setup(fmt)
    sink = rec["formats"].setdefault(fmt, {"variants": {}})["variants"]
    run_variant(rec, sink, "engine", lambda: engine_result(chain, rec["copy_gbs"]), out, f"{fmt}/")
    for cfg in configs:
        per_sm, warps, pre = (int(v) for v in cfg.split(":"))

        def one(per_sm=per_sm, warps=warps, pre=pre):
            run = Persistent(fmt, mats, bufs, per_sm, warps, pre)
            res = time_persistent(run, steps, rec["copy_gbs"])
            return {**res, "blocks": run.blocks, "programs": run.progs, "maxnreg": run.maxnreg,
                    "prefetch": pre, "warps": warps}

        run_variant(rec, sink, f"persistent_{cfg.replace(':', '_')}", one, out, f"{fmt}/")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--formats", default="int8,int4")
    ap.add_argument("--configs", default="1:16:1,1:16:2,2:8:1,2:8:2,1:16:0",
                    help="PER_SM:warps:PREFETCH (0 none, 1 tile, 2 first half), comma-separated")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    rec = new_record("h200-persistent-gemv-chain")
    rec["formats"] = {}
    for fmt in args.formats.split(","):
        run_format(rec, fmt, args.configs.split(","), args.out)
        torch.cuda.empty_cache()  # the format's weights went with run_format's frame
    finish(rec, args.out)


if __name__ == "__main__":
    main()
