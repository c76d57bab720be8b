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

Variants (--variants, each KIND[_trigT][_laD][_tl]; the engine's own kernel runs first and last):
  KIND      full (the engine's math: ops/triton_qgemv's _weights and _step, tile mode, one K-step;
            checked against dequantize-then-F.linear on each step's actual input, written rows
            poisoned first), nodot, noweights, empty (above);
  _trigT    when a program releases the next kernel (griddepcontrol.launch_dependents): 0 after
            its wait (the engine), 1 once its weights have arrived, before its wait (the release
            takes an input computed from every loaded word), 2 at entry ("early");
  _laD      before its wait, ask L2 for the weights of the GEMV D steps ahead (one
            prefetch.global.L2 per 128-byte line over every lane of the grid; the chain wraps);
  _gateD    released at entry ("early"), then each program spins (a volatile load of a counter,
            _sleepN: nanosleep N ns between polls) until every program of the GEMV D steps back
            has finished, before loading its weights: the launch latency hidden, the weight
            streams in flight bounded to D GEMVs (full only; counters zeroed by a memset node);
  _tl       one more replay with a %globaltimer stamp per program (entry, after the wait, x
            loaded, result ready): per step the first and last of each, and means over the chain.
"""

import argparse
import re
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
from qgemv_chain import rel  # noqa: E402

from deltaserve.ops import triton_qgemv as tq  # noqa: E402
from deltaserve.ops.backend import gdc_launch_dependents, gdc_wait  # noqa: E402
from deltaserve.ops.qgemv import qgemv_ref  # noqa: E402
from deltaserve.quant.schemes import FORMATS  # noqa: E402

WORK = {"nodot": 1, "noweights": 2, "empty": 3}
DEFAULT_VARIANTS = ["full", "full_trig2_tl", "full_gate2", "full_gate2_sleep200", "full_gate3",
                    "full_gate3_sleep200", "full_gate2_tl", "full_gate4_sleep200"]


@triton.jit
def _prefetch_l2(base, num_bytes, LANES: tl.constexpr):
    """Asks L2 for num_bytes from base (int8 pointer), one 128-byte line per lane and round, the
    lines spread over every lane of the grid. Nothing waits for it."""
    pid, progs = tl.program_id(0), tl.num_programs(0)
    base = base.to(tl.pointer_type(tl.int8))
    lines = (num_bytes + 127) // 128
    for j in range(0, tl.cdiv(lines, progs * LANES)):
        line = (j * progs + pid).to(tl.int64) * LANES + tl.arange(0, LANES)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.lt.s64 p, $2, $3; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
            "=r,l,l,l", [base + line * 128, line, lines + tl.zeros_like(line)], dtype=tl.int32,
            is_pure=False, pack=1)


@triton.jit
def _prefetch_next(PW, PS, PB, pw_bytes, ps_bytes, HAS_BIAS: tl.constexpr, LANES: tl.constexpr):
    """The lookahead GEMV's codes, scales and biases into L2."""
    _prefetch_l2(PW, pw_bytes, LANES)
    _prefetch_l2(PS, ps_bytes, LANES)
    if HAS_BIAS:
        _prefetch_l2(PB, ps_bytes, LANES)


@triton.jit
def _stamp(dep):
    """%globaltimer (ns) once dep is computed (the asm takes it as an input)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [dep], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _trigger_after(dep):
    """griddepcontrol.launch_dependents once dep (computed from every loaded weight) is ready:
    the next kernel may launch when this one's weights have arrived, before its wait."""
    tl.inline_asm_elementwise("griddepcontrol.launch_dependents; mov.u32 $0, $1;", "=r,r", [dep],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _full_kernel(W, S, B, X, Y, N, K, PW, PS, PB, pw_bytes, ps_bytes, T, CNT, GATE_AT,
                 gate_target, G: tl.constexpr, BITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MAGIC: tl.constexpr,
                 LANES: tl.constexpr, PF: tl.constexpr, TIMED: tl.constexpr,
                 TRIG: tl.constexpr, GATE: tl.constexpr, SLEEP: tl.constexpr):
    """The engine's tile-mode GEMV (one K-step: BLOCK_K >= K), plus, with PF, the lookahead
    GEMV's weights asked of L2 first. TIMED: the program's timeline into T[pid] (_timeline).
    GATE: released at entry, then no weight load until GATE_AT (the counter of the GEMV GATE
    steps back) reaches gate_target (its program count); this GEMV's own counter CNT counts
    its finished programs."""
    pid = tl.program_id(0)
    if TIMED:
        tl.store(T + pid * 4, _stamp(pid))
    if GATE:
        gdc_launch_dependents()
        _gate(GATE_AT, gate_target, SLEEP)
    if PF:
        _prefetch_next(PW, PS, PB, pw_bytes, ps_bytes, HAS_BIAS, LANES)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    if TRIG == 2:
        gdc_launch_dependents()
    q, s, b = tq._weights(W, S, B, rows, row_ok, 0, K, K // G, G, BITS, HAS_BIAS, BLOCK_K)
    if TRIG == 1:
        _trigger_after(tl.xor_sum(tl.xor_sum(q.to(tl.int32), axis=1), axis=0))
    gdc_wait()
    if TRIG == 0 and GATE == 0:
        gdc_launch_dependents()
    if TIMED:
        tl.store(T + pid * 4 + 1, _stamp(pid))
    acc = tl.zeros([BLOCK_N, BLOCK_K // G], dtype=tl.float32)
    acc = tq._step(acc, q, s, b, X, X, X, 1.0, 0.0, 0, K, G, BITS, HAS_BIAS, BLOCK_N, BLOCK_K,
                   MAGIC, 0)
    y = tl.sum(acc, axis=1)
    if TIMED:
        _done(T, pid, y, BLOCK_N)
    tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=row_ok)
    if GATE:
        tl.atomic_add(CNT, 1, sem="relaxed", scope="gpu")


@triton.jit
def _gate(C, target, SLEEP: tl.constexpr):
    """Spin until C reaches target (relaxed: it orders no data, only when the weights stream). A
    bounded spin: past ~200k polls it sets C[1] and goes on (flagged, rather than a hung device)."""
    seen = tl.load(C, volatile=True)
    tries = 0
    while (seen < target) & (tries < 200_000):
        if SLEEP:
            tries = tl.inline_asm_elementwise(f"nanosleep.u32 {SLEEP}; mov.b32 $0, $1;", "=r,r",
                                              [tries], dtype=tl.int32, is_pure=False, pack=1)
        seen = tl.load(C, volatile=True)
        tries += 1
    if seen < target:
        tl.atomic_xchg(C + 1, 1)


@triton.jit
def _done(T, pid, y, BLOCK_N: tl.constexpr):
    """T[pid, 3]: the time row 0's result was ready (the row sums span the program's warps, so
    every row is ready about then)."""
    first = tl.arange(0, BLOCK_N) == 0
    tl.store(T + pid * 4 + 3 + tl.zeros([BLOCK_N], dtype=tl.int32),
             _stamp(y.to(tl.int32, bitcast=True)), mask=first)


@triton.jit
def _attrib_kernel(W, S, B, X, Y, N, K, NUM_WORDS, NUM_GROUPS, PW, PS, PB, pw_bytes, ps_bytes, T,
                   HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr, WORK: tl.constexpr,
                   LANES: tl.constexpr, PF: tl.constexpr, TIMED: tl.constexpr,
                   TRIG: tl.constexpr):
    """One program: BLOCK_N rows. WORK 1 nodot, 2 noweights, 3 empty (module docstring); PF: the
    lookahead GEMV's weights asked of L2 first; TIMED: the timeline into T[pid] (_timeline)."""
    pid = tl.program_id(0)
    if TIMED:
        tl.store(T + pid * 4, _stamp(pid))
    if PF:
        _prefetch_next(PW, PS, PB, pw_bytes, ps_bytes, HAS_BIAS, LANES)
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
        if TRIG == 1:
            _trigger_after(tl.xor_sum(tl.xor_sum(q, axis=1), axis=0))
    if TRIG == 2 or (TRIG == 1 and WORK != 1):
        gdc_launch_dependents()
    gdc_wait()
    if TRIG == 0:
        gdc_launch_dependents()
    if TIMED:
        tl.store(T + pid * 4 + 1, _stamp(pid))
    y = tl.zeros([BLOCK_N], dtype=tl.float32)
    if WORK <= 2:
        cols = tl.arange(0, BLOCK_K)
        x = tl.load(X + cols, mask=cols < K, other=0.0).to(tl.float32)
        x_mean = tl.sum(x, 0) / K
        if TIMED:
            tl.store(T + pid * 4 + 2, _stamp(x_mean.to(tl.int32, bitcast=True)))
        y += x_mean
    if WORK == 1:
        h = tl.xor_sum(q, axis=1)
        y += (h & 0xFFFF).to(tl.float32) * 1e-30 + tl.sum(s, axis=1) * 1e-30
    if TIMED:
        _done(T, pid, y, BLOCK_N)
    tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=row_ok)


def launch_shape(scheme, n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, MAGIC) the engine launches: TUNED_PDL, whole-K tile."""
    block_n, block_k, warps, _, magic = tq.whole_k_config(
        tq.config_for(scheme.bits, n, k, tq.TUNED_PDL), scheme.bits, k)
    return block_n, max(block_k, scheme.group_size), warps, magic


def ahead_args(steps, i: int, ahead: int) -> tuple:
    """The lookahead GEMV's weight pointers and byte counts (PW, PS, PB, pw_bytes, ps_bytes)."""
    p = steps[(i + ahead) % len(steps)][0]
    s = p["scales"]
    return (p["weight"], s, p.get("biases", s), p["weight"].numel() * p["weight"].element_size(),
            s.numel() * s.element_size())


class Attrib:
    """The chain's steps launched with _attrib_kernel (WORK 1-3) or _full_kernel (WORK 0), with
    the lookahead prefetch `ahead` steps on (0: none)."""

    def __init__(self, fmt: str, bufs: torch.Tensor, steps, work: int, opts: dict):
        self.scheme, self.bufs, self.steps, self.work = FORMATS[fmt], bufs, steps, work
        self.ahead, self.timed, self.trig = opts.get("la", 0), "tl" in opts, opts.get("trig", 0)
        self.gate, self.sleep = opts.get("gate", 0), opts.get("sleep", 0)
        self.counters = torch.zeros(len(steps) * 32, dtype=torch.int32, device=bufs.device)
        self.programs = [triton.cdiv(n, launch_shape(self.scheme, n, k)[0]) for _, n, k in steps]
        self.times = torch.zeros(len(steps), max(self.programs), 4, dtype=torch.int64,
                                 device=bufs.device)

    def gate_args(self, i: int) -> tuple:
        """CNT (this step's counter), GATE_AT (the counter GATE steps back), gate_target."""
        cnt = self.counters[i * 32:]
        if not self.gate or i < self.gate:
            return cnt, cnt[2:], 0
        return cnt, self.counters[(i - self.gate) * 32:], self.programs[i - self.gate]

    def launch(self) -> None:
        s = self.scheme
        if self.gate:  # a memset node: each replay counts from zero
            self.counters.zero_()
        for i, (p, n, k) in enumerate(self.steps):
            block_n, block_k, warps, magic = launch_shape(s, n, k)
            if block_k < k:
                raise ValueError(f"{n}x{k}: the tile is not whole-K ({block_k})")
            x, y = self.bufs[i, :, :k], self.bufs[i + 1, :, :n]
            ahead = ahead_args(self.steps, i, self.ahead or 1)
            common = {"HAS_BIAS": s.has_biases(), "BLOCK_N": block_n, "BLOCK_K": block_k,
                      "LANES": 32 * warps, "PF": bool(self.ahead), "TIMED": self.timed,
                      "TRIG": self.trig,
                      "num_warps": warps, "launch_pdl": True}
            grid = (triton.cdiv(n, block_n),)
            if self.work == 0:
                _full_kernel[grid](tq._words(p, s), p["scales"], p.get("biases", p["scales"]), x,
                                   y, n, k, *ahead, self.times[i], *self.gate_args(i), G=s.group_size,
                                   BITS=s.bits, MAGIC=magic, GATE=self.gate, SLEEP=self.sleep,
                                   **common)
                continue
            words = p["weight"].view(torch.int32)
            num_words, num_groups = words.shape[-1], p["scales"].shape[-1]
            _attrib_kernel[grid](words, p["scales"], p.get("biases", p["scales"]), x, y, n, k,
                                 num_words, num_groups, *ahead, self.times[i],
                                 BLOCK_W=triton.next_power_of_2(num_words),
                                 BLOCK_G=triton.next_power_of_2(num_groups), WORK=self.work,
                                 **common)

    def check(self, graph) -> float:
        """Poison every written row, replay once, worst step error vs the reference."""
        for i, (_, n, _) in enumerate(self.steps):
            self.bufs[i + 1, :, :n].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        if self.counters.view(-1, 32)[:, 1].any():
            raise RuntimeError("a gate's spin gave up")
        return max(rel(self.bufs[i + 1, :, :n], qgemv_ref(self.bufs[i, :, :k], p, self.scheme))
                   for i, (p, n, k) in enumerate(self.steps))


def timed(rec: dict, fmt: str, bufs, steps, spec: str) -> dict:
    """One variant, spec KIND[_trigT][_laD][_tl] (module docstring), timed, its timeline taken
    with _tl, checked where it computes the GEMV."""
    parts = spec.split("_")
    opts = {m[1]: int(m[2] or 0) for m in (re.fullmatch(r"([a-z]+)(\d*)", p) for p in parts[1:])}
    work = 0 if parts[0] == "full" else WORK[parts[0]]
    if opts.get("gate") and work:
        raise ValueError("gate: full only")
    run = Attrib(fmt, bufs, steps, work, opts)
    graph, res = time_graph(run.launch, steps, rec["copy_gbs"])
    if run.timed:
        run.times.zero_()
        graph.replay()
        torch.cuda.synchronize()
        res["timeline"] = _timeline(run.times.cpu(), run.programs, steps)
    if work == 0:
        res["max_rel_err"] = run.check(graph)
    return res


def _timeline(times: torch.Tensor, programs: list[int], steps) -> dict:
    """One replay's per-program stamps [step, program, (entry, after the wait, x loaded, result
    ready)] (ns, %globaltimer) -> per step the first / last of each, in us from the first entry,
    and their means over the chain: how far step i+1 started before step i ended, how long after
    step i's last result step i+1 passed its wait, and how long the work after the wait took."""
    t0 = times[0, :programs[0], 0].min().item()
    per = []
    for i, n in enumerate(programs):
        t = (times[i, :n].double() - t0) / 1e3
        per.append({"step": i, "n": steps[i][1], "k": steps[i][2], "programs": n,
                    "entry": [t[:, 0].min().item(), t[:, 0].max().item()],
                    "waited": [t[:, 1].min().item(), t[:, 1].max().item()],
                    "x_loaded_last": t[:, 2].max().item() if times[i, :n, 2].any() else None,
                    "ready": [t[:, 3].min().item(), t[:, 3].max().item()]})
    gaps = {"next_first_entry_before_end": [], "next_last_entry_after_end": [],
            "next_first_wait_after_end": [], "last_wait_to_last_ready": [], "period": []}
    for a, b in zip(per, per[1:], strict=False):
        end = a["ready"][1]
        gaps["next_first_entry_before_end"].append(end - b["entry"][0])
        gaps["next_last_entry_after_end"].append(b["entry"][1] - end)
        gaps["next_first_wait_after_end"].append(b["waited"][0] - end)
        gaps["last_wait_to_last_ready"].append(a["ready"][1] - a["waited"][1])
        gaps["period"].append(b["ready"][1] - end)
    means = {key: sum(v) / len(v) for key, v in gaps.items()}
    return {"mean_us": means, "steps": per[:12], "chain_us": per[-1]["ready"][1]}


def run_format(rec: dict, fmt: str, variants: list[str], out: str) -> None:
    _, bufs, steps, chain = chain_setup(fmt)
    sink = rec["formats"].setdefault(fmt, {"variants": {}})["variants"]
    run_variant(rec, sink, "engine", lambda: engine_result(chain, rec["copy_gbs"]), out, f"{fmt}/")
    for spec in variants:
        run_variant(rec, sink, spec, lambda v=spec: timed(rec, fmt, bufs, steps, v), out,
                    f"{fmt}/")
    run_variant(rec, sink, "engine_repeat", lambda: engine_result(chain, rec["copy_gbs"]), out,
                f"{fmt}/")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--formats", default="int8,int4")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                    help="KIND[_trigT][_laD][_tl], comma-separated (module docstring)")
    args = ap.parse_args()
    rec = new_record("h200-pdl-chain-attribution")
    rec["formats"] = {}
    for fmt in args.formats.split(","):
        run_format(rec, fmt, args.variants.split(","), args.out)
        torch.cuda.empty_cache()
    finish(rec, args.out)


if __name__ == "__main__":
    main()
