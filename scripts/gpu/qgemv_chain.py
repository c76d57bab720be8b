"""Decode-like chains of quantized GEMVs in one CUDA graph, with and without programmatic dependent
launch (PDL, Hopper); writes one JSON record.

    python scripts/gpu/qgemv_chain.py --out $OUT/qgemv_chain.json [--jobs 12] [--sweep] [--quick]

Why: one layer matrix of Qwen3.5-0.8B is 2-8 MB, which streams in 0.5-2 us at copy speed, while a
launch costs ~0.7 us and the first DRAM round trip ~1 us; measured one kernel at a time the GEMV
reaches 17-41% of copy bandwidth (qgemv_tune.py). In decode the GEMVs run back to back in a graph:
under PDL each one may load its (static) weights before waiting for its predecessor.

What it does, per format (int8; int4 = 4-bit affine, group 64):
  copy bandwidth: clone of 2 GiB, read + write bytes over time (as qgemv_tune.py);
  check: every variant against dequantize-then-F.linear on fresh random weights and x, output
    poisoned with NaN first, on the model's shapes and on shapes that are no multiple of a block;
  model chain: the layer GEMVs of all 24 layers in order (18 GDN: in_proj 8224x1024, out_proj
    1024x2048, gate_up 7168x1024, down 1024x3584; 6 attention, every 4th: qkv 5120x1024, o_proj
    1024x2048, the same MLP), each layer its own weights (L2-cold), each GEMV reading x from a row
    the previous GEMV wrote (a true dependence), timed as graph replays; after timing, the written
    rows are poisoned with NaN, the graph replayed once and every step checked against the
    reference on its actual input (a read of x before the predecessor wrote it shows as NaN);
  per shape: the same for a chain of one shape over distinct weight copies (>= 4x the 50 MB L2),
    and the old isolated L2-cold number (fixed x, no dependence, no PDL: qgemv_tune.py's way);
  bytes = codes + fp32 scales (+ biases) + x; GB/s = bytes / time; % of the copy bandwidth.
Variants: nopdl (the tuned configs), nopdl_tile (PDL off, the tile mode's whole-K BLOCK_K: the
config's own effect), wait (PDL, gdc_wait first), block (first K-step of weights before the wait),
tile (the whole [BLOCK_N, K] tile before the wait where it fits), early (tile, the next kernel
released before this one's wait). --sweep: per shape, tile mode over SWEEP's launch shapes in
that shape's chain; the best is variant "tuned" there and, per shape, in the model chain (the
per-shape chains run first for that). A failing variant is recorded and the others go on.
"""

import argparse
import ctypes
import json
import math
import os
import subprocess
import sys
import traceback
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from qgemv_tune import L2_BYTES, _noop, packed_for  # noqa: E402

try:  # only for the stand-in kernel between GEMVs; the GEMV takes its own from triton_qgemv
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    _HAS_GDC = True
except ImportError:
    _HAS_GDC = False

from deltaserve.bench.gpu import (  # noqa: E402
    copy_bandwidth_gbs,
    cuda_median_s,
    gpu_state,
    graph_replay_s,
)
from deltaserve.ops import triton_qgemv as tq  # noqa: E402
from deltaserve.ops.qgemv import qgemv_ref  # noqa: E402
from deltaserve.quant.schemes import FORMATS, quantize  # noqa: E402

GDN = [("in_proj", 8224, 1024), ("out_proj", 1024, 2048), ("gate_up", 7168, 1024),
       ("down", 1024, 3584)]
ATTN = [("qkv", 5120, 1024), ("o_proj", 1024, 2048), ("gate_up", 7168, 1024),
        ("down", 1024, 3584)]
LAYERS = 24
FORMATS_RUN = ["int8", "int4"]  # --formats
# (BLOCK_N, num_warps) tried per shape in tile-mode PDL (--sweep)
SWEEP = [(2, 2), (2, 4), (4, 2), (4, 4), (4, 8), (8, 2), (8, 4), (8, 8), (16, 4), (16, 8)]
SWEEP_MAGIC: list[int] = []  # --magic: the MAGIC values swept (default: the usual one and 2)
SWEEP_PDL = ["tile"]  # --sweep-pdl: the PDL mode the sweep's configs run in (tile or early)
VARIANTS = ["nopdl", "nopdl_tile", "wait", "block", "tile", "early"]
ODD_SHAPES = [(37, 384), (1000, 1344), (333, 2112)]  # rows / columns no multiple of a block
TOL = 1e-5


def layer_steps() -> list[tuple[str, int, int]]:
    """(name, N, K) of every layer GEMV in decode order: attention is every 4th layer."""
    return [(f"L{i}.{name}", n, k) for i in range(LAYERS)
            for name, n, k in (ATTN if i % 4 == 3 else GDN)]


def call_args(variant: str, bits: int, n: int, k: int, tuned: dict | None = None):
    """(config, pdl keyword) for qgemv_cuda; "tuned" is SWEEP_PDL's mode (tile unless --sweep-pdl
    says early) with the sweep's config."""
    if variant == "tuned":
        return tuned[(n, k)], SWEEP_PDL[0]
    if variant == "engine":  # what the engine launches: TUNED_PDL's config, tile mode
        return tq.config_for(bits, n, k, tq.TUNED_PDL), "tile"
    cfg = tq.config_for(bits, n, k)
    if variant == "nopdl":
        return cfg, False
    if variant == "nopdl_tile":
        return tq.whole_k_config(cfg, bits, k), False
    return cfg, variant


def effective_config(variant: str, bits: int, n: int, k: int, tuned: dict | None = None):
    """The launch config the kernel gets (tile / early widen BLOCK_K to all of K where it fits)."""
    cfg, pdl = call_args(variant, bits, n, k, tuned)
    return list(tq.whole_k_config(cfg, bits, k) if pdl in ("tile", "early") else cfg)


def packed_gpu(fmt: str, n: int, k: int, seed: int) -> dict:
    """Our quantizer on GPU (randn / sqrt(K): activations keep their scale along a chain); the CPU
    quantizer if a GPU op is missing."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, generator=g, device="cuda") / math.sqrt(k)
    try:
        q = quantize(w, FORMATS[fmt])
    except RuntimeError:
        q = {key: v.cuda() for key, v in quantize(w.cpu(), FORMATS[fmt]).items()}
    return {key: (v.float() if v.is_floating_point() else v) for key, v in q.items()}


def nbytes(p: dict, k: int) -> int:
    return sum(v.numel() * v.element_size() for v in p.values()) + 4 * k


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    return err if math.isfinite(err) else float("inf")


class Chain:
    """GEMV i reads row i of `bufs` (its first K_i values) and writes row i + 1 (first N_i)."""

    def __init__(self, fmt: str, steps: list[tuple[str, dict, int, int]]):
        self.scheme, self.steps = FORMATS[fmt], steps
        width = max(max(n, k) for _, _, n, k in steps)
        self.bufs = torch.randn(len(steps) + 1, 1, width, device="cuda")
        self.bytes = sum(nbytes(p, k) for _, p, _, k in steps)
        self.tuned: dict = {}  # (N, K) -> config for the "tuned" variant

    def launch(self, variant: str) -> None:
        """variant "V+OP": OP runs in place on each output before the next GEMV reads it, as a
        decode step's norms and activations do: torch (an elementwise torch kernel), plainop /
        pdlop (a Triton kernel, launched plainly / with PDL and gdc_wait first)."""
        base, _, between = variant.partition("+")
        for i, (_, p, n, k) in enumerate(self.steps):
            cfg, pdl = call_args(base, self.scheme.bits, n, k, self.tuned)
            y = self.bufs[i + 1, :, :n]
            tq.qgemv_cuda(self.bufs[i, :, :k], p, self.scheme, config=cfg, pdl=pdl, out=y)
            if between and i + 1 < len(self.steps):
                in_place_op(y, between)

    def check(self, graph) -> float:
        """Poison every written row, replay once, worst step error vs the reference."""
        for i, (_, _, n, _) in enumerate(self.steps):
            self.bufs[i + 1, :, :n].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        return max(rel(self.bufs[i + 1, :, :n], qgemv_ref(self.bufs[i, :, :k], p, self.scheme))
                   for i, (_, p, n, k) in enumerate(self.steps))


def time_chain(chain: Chain, variant: str, copy_gbs: float) -> dict:
    chain.launch(variant)  # compile / warm outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain.launch(variant)
    sec = cuda_median_s(graph.replay, 50)
    gbs = chain.bytes / sec / 1e9
    out = {"chain_us": sec * 1e6, "us_per_gemv": sec * 1e6 / len(chain.steps),
           "bytes": chain.bytes, "gbs": gbs, "pct_of_copy": 100 * gbs / copy_gbs}
    out["max_rel_err"] = chain.check(graph)
    out["final"] = chain.bufs[-1].clone()
    del graph
    return out


def run_variants(chain: Chain, copy_gbs: float, errors: list, where: str) -> dict:
    """Every variant (nopdl again last: its repeat is the noise estimate)."""
    res = {}
    for variant in [*VARIANTS, *(["tuned"] if chain.tuned else []), "nopdl"]:
        key = variant if variant not in res else "nopdl_repeat"
        try:
            res[key] = time_chain(chain, variant, copy_gbs)
        except Exception as exc:  # one variant's failure is a result, not the end of the run
            errors.append({"where": f"{where}/{variant}", "error": repr(exc)[:400],
                           "trace": traceback.format_exc()[-1500:]})
    base = res.get("nopdl", {}).get("final")
    for r in res.values():
        final = r.pop("final")
        r["rel_vs_nopdl"] = rel(final, base) if base is not None else None
    return res


def check_fresh(fmt: str, errors: list) -> list[dict]:
    """Each variant vs dequantize-then-F.linear on fresh weights and x; output poisoned first."""
    s, rows = FORMATS[fmt], []
    shapes = sorted({(n, k) for _, n, k in GDN + ATTN}) + ODD_SHAPES
    for j, (n, k) in enumerate(shapes):
        p = packed_for(fmt, n, k, torch.device("cuda"), seed=1000 + j)
        x = torch.randn(1, k, device="cuda")
        ref = qgemv_ref(x, p, s)
        for variant in VARIANTS:
            try:
                cfg, pdl = call_args(variant, s.bits, n, k)
                out = torch.full((1, n), float("nan"), device="cuda")
                tq.qgemv_cuda(x, p, s, config=cfg, pdl=pdl, out=out)
                rows.append({"shape": [n, k], "variant": variant, "rel_err": rel(out, ref)})
            except Exception as exc:
                errors.append({"where": f"check/{fmt}/{n}x{k}/{variant}", "error": repr(exc)[:400]})
    return rows


def model_chain(fmt: str, copy_gbs: float, errors: list, tuned: dict) -> dict:
    steps = [(name, packed_gpu(fmt, n, k, seed=i), n, k)
             for i, (name, n, k) in enumerate(layer_steps())]
    chain = Chain(fmt, steps)
    chain.tuned = tuned if all((n, k) in tuned for _, _, n, k in steps) else {}
    out = {"gemvs": len(steps), "bytes": chain.bytes,
           "tuned": {f"{n}x{k}": list(c) for (n, k), c in chain.tuned.items()},
           "variants": run_variants(chain, copy_gbs, errors, f"{fmt}/model")}
    pdl = "tuned" if chain.tuned else "tile"
    out["interleaved"] = {}  # a small kernel between GEMVs (bytes: the GEMVs' alone)
    for variant in ["nopdl+torch", f"{pdl}+torch", f"{pdl}+plainop", f"{pdl}+pdlop"]:
        r = guarded(errors, f"{fmt}/model/{variant}",
                    lambda v=variant: time_chain(chain, v, copy_gbs))
        if r:
            r.pop("final")
            out["interleaved"][variant] = r
    return out


if _HAS_GDC:

    @triton.jit
    def _scale_kernel(Y, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """y *= 1 in place: a stand-in for the small kernels between a decode step's GEMVs."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        tl.store(Y + offs, tl.load(Y + offs, mask=ok) * 1.0, mask=ok)


def in_place_op(y: torch.Tensor, kind: str) -> None:
    if kind == "torch":
        y.mul_(1.0)
        return
    pdl = kind == "pdlop"
    extra = {"launch_pdl": True} if pdl else {}
    _scale_kernel[(triton.cdiv(y.numel(), 1024),)](y, y.numel(), BLOCK=1024, PDL=pdl,
                                                    num_warps=4, **extra)


def sweep_configs(bits: int) -> list[tuple]:
    """SWEEP's shapes x MAGIC (SWEEP_MAGIC, or the format's usual conversion and 2): 2 byte
    permutes (ops/triton_qgemv._bytes_magic / _nibbles_magic). (A MAGIC 3, the first K-step
    converted before the PDL wait, was swept at 0066b5b and removed: slower on every shape.)"""
    magics = SWEEP_MAGIC or (1 if bits == 8 else 0, 2)
    return [(bn, 1024, w, 1, magic) for bn, w in SWEEP for magic in magics]


def sweep(chain: Chain, n: int, k: int, copy_gbs: float, errors: list) -> list[dict]:
    """Tile-mode PDL over SWEEP's configs on this shape's chain (BLOCK_K widened to all of K
    where the tile fits): which launch shape overlaps best with its neighbours."""
    rows = []
    for cfg in sweep_configs(chain.scheme.bits):
        chain.tuned = {(n, k): cfg}
        try:
            r = time_chain(chain, "tuned", copy_gbs)
            r.pop("final")
            rows.append({"config": effective_config("tuned", chain.scheme.bits, n, k,
                                                    chain.tuned), **r})
        except Exception as exc:
            errors.append({"where": f"sweep/{n}x{k}/{cfg}", "error": repr(exc)[:300]})
    chain.tuned = {}
    return rows


def shape_chain(fmt: str, n: int, k: int, copy_gbs: float, errors: list, do_sweep: bool) -> dict:
    one = packed_gpu(fmt, n, k, seed=7)
    copies = max(4, math.ceil(4 * L2_BYTES / nbytes(one, k)))
    steps = [(f"{n}x{k}#{c}", one if c == 0 else packed_gpu(fmt, n, k, seed=7 + c), n, k)
             for c in range(copies)]
    chain = Chain(fmt, steps)
    x, s = torch.randn(1, k, device="cuda"), FORMATS[fmt]
    old = graph_replay_s([lambda p=p: tq.qgemv_cuda(x, p, s) for _, p, _, _ in steps])
    old_gbs = nbytes(one, k) / old / 1e9
    configs = {v: effective_config(v, s.bits, n, k) for v in VARIANTS}
    row = {"shape": [n, k], "copies": copies, "bytes_one": nbytes(one, k), "configs": configs,
           "isolated_old_way": {"us": old * 1e6, "gbs": old_gbs,
                                "pct_of_copy": 100 * old_gbs / copy_gbs},
           "variants": run_variants(chain, copy_gbs, errors, f"{fmt}/{n}x{k}")}
    if do_sweep:
        row["sweep"] = sweep(chain, n, k, copy_gbs, errors)
        ok = [r for r in row["sweep"] if r["max_rel_err"] <= TOL]
        if ok:
            best = min(ok, key=lambda r: r["chain_us"])
            row["variants"]["tuned"] = {kk: v for kk, v in best.items() if kk != "config"}
            row["configs"]["tuned"] = best["config"]
    return row


def shares(model: dict, shapes: list[dict]) -> dict:
    """Per shape: its count in the model chain, its byte share, and per variant its estimated time
    share (count x per-GEMV time in its own chain) and the sum of those estimates in us."""
    counts: dict = {}
    for _, n, k in layer_steps():
        counts[(n, k)] = counts.get((n, k), 0) + 1
    out = {}
    for row in shapes:
        key = tuple(row["shape"])
        out[f"{key[0]}x{key[1]}"] = {"count": counts[key],
                                     "byte_share": counts[key] * row["bytes_one"] / model["bytes"]}
    tuned = ["tuned"] if all("tuned" in r["variants"] for r in shapes) else []
    for variant in [*VARIANTS, *tuned]:
        est = {f"{r['shape'][0]}x{r['shape'][1]}": counts[tuple(r["shape"])]
               * r["variants"].get(variant, {}).get("us_per_gemv", float("nan")) for r in shapes}
        total = sum(est.values())
        for name, us in est.items():
            out[name][f"time_share_{variant}"] = us / total
        out.setdefault("_estimated_chain_us", {})[variant] = total
    return out


def asm_facts(fmt: str) -> dict:
    """Per variant (in_proj shape): where the PTX puts griddepcontrol.wait among the global loads,
    registers and spills."""
    s, facts = FORMATS[fmt], {}
    n, k = GDN[0][1], GDN[0][2]
    p, x = packed_gpu(fmt, n, k, seed=3), torch.randn(1, k, device="cuda")
    w = p["weight"].view(torch.int32) if s.kind == "affine" else p["weight"]
    for variant in VARIANTS:
        cfg, pdl = call_args(variant, s.bits, n, k)
        y = torch.empty(1, n, device="cuda")
        kern = tq._launch(x, p, s, w, y, y, cfg, False, pdl)
        lines = kern.asm["ptx"].splitlines()
        wait = next((i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln), None)
        loads = [i for i, ln in enumerate(lines) if "ld.global" in ln]
        facts[variant] = {"config": effective_config(variant, s.bits, n, k),
                          "ld_global": len(loads), "wait_line": wait,
                          "ld_global_before_wait": sum(i < wait for i in loads) if wait else 0,
                          "regs": getattr(kern, "n_regs", None),
                          "spills": getattr(kern, "n_spills", None)}
    return facts


def graph_dot(fmt: str, out_dir: Path) -> dict:
    """Capture 3 PDL GEMVs with the graph's debug dump: are the edges programmatic?"""
    steps = [(name, packed_gpu(fmt, n, k, seed=50 + i), n, k)
             for i, (name, n, k) in enumerate(GDN[:3])]
    chain = Chain(fmt, steps)
    chain.launch("tile")
    try:  # keep the captured graph (not only its executable) for the dump
        graph = torch.cuda.CUDAGraph(keep_graph=True)
    except TypeError:
        graph = torch.cuda.CUDAGraph()
    graph.enable_debug_mode()
    with torch.cuda.graph(graph):
        chain.launch("tile")
    try:
        edges = graph_edges(graph)
    except Exception as exc:
        edges = [{"error": repr(exc)[:200]}]
    path = out_dir / f"pdl_graph_{fmt}.dot"
    graph.debug_dump(str(path))
    if not path.is_file():
        return {"file": None, "note": "debug_dump wrote no file", "edges": edges}
    text = path.read_text(errors="replace")
    lines = [ln.strip() for ln in text.splitlines() if "->" in ln or "rogrammatic" in ln]
    return {"file": path.name, "programmatic_mentions": text.lower().count("programmatic"),
            "edge_lines": lines[:12], "edges": edges}


def graph_edges(graph) -> list[dict]:
    """The captured graph's edges as the driver reports them (cuGraphGetEdges_v2): CUgraphEdgeData
    is {from_port, to_port, type, reserved[5]}; type 1 = programmatic, from_port 1 = programmatic
    port, 2 = launch completion."""
    get = ctypes.CDLL("libcuda.so.1").cuGraphGetEdges_v2
    handle, num = ctypes.c_void_p(graph.raw_cuda_graph()), ctypes.c_size_t(0)
    rc = get(handle, None, None, None, ctypes.byref(num))
    if rc:
        return [{"error": f"cuGraphGetEdges_v2 (count) returned {rc}"}]
    frm, to = (ctypes.c_void_p * num.value)(), (ctypes.c_void_p * num.value)()
    data = (ctypes.c_uint8 * (8 * num.value))()
    rc = get(handle, frm, to, data, ctypes.byref(num))
    if rc:
        return [{"error": f"cuGraphGetEdges_v2 returned {rc}"}]
    return [{"from_port": data[8 * i], "to_port": data[8 * i + 1], "type": data[8 * i + 2]}
            for i in range(num.value)]


def compile_one(job) -> str:
    fmt, variant, n, k, tuned = job
    try:
        s = FORMATS[fmt]
        cfg, pdl = call_args(variant, s.bits, n, k, tuned)
        p, x = packed_gpu(fmt, n, k, seed=0), torch.randn(1, k, device="cuda")
        tq.qgemv_cuda(x, p, s, config=cfg, pdl=pdl, out=torch.empty(1, n, device="cuda"))
        torch.cuda.synchronize()
        return "ok"
    except Exception as exc:
        return repr(exc)[:200]


def warm_cache(jobs: int, with_sweep: bool) -> dict:
    """Compile every (format, variant, shape) in a process pool first: Triton's disk cache then
    serves this process, so compiles stay out of the device time spent serially. One job per
    distinct kernel (same config and mode: same binary for every shape here)."""
    seen, todo = set(), []
    for fmt in FORMATS_RUN:
        bits = FORMATS[fmt].bits
        for n, k in sorted({(n, k) for _, n, k in GDN + ATTN}):
            cands = [(v, None) for v in VARIANTS]
            cands += [("tuned", {(n, k): c}) for c in sweep_configs(bits)] if with_sweep else []
            for v, tuned in cands:
                key = (fmt, call_args(v, bits, n, k, tuned)[1],
                       tuple(effective_config(v, bits, n, k, tuned)))
                if key not in seen:
                    seen.add(key)
                    todo.append((fmt, v, n, k, tuned))
    try:
        ctx = torch.multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
            res = list(pool.map(compile_one, todo))
        return {"compiled": len(todo), "failed": [r for r in res if r != "ok"][:5]}
    except Exception as exc:
        return {"error": repr(exc)[:300]}


def git_commit() -> str:
    env = os.environ.get("DELTASERVE_GIT_COMMIT")
    if env:
        return env
    out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip()


def empty_kernel_us() -> dict:
    y = torch.empty(1, device="cuda")
    plain = graph_replay_s([lambda: _noop[(1,)](y)] * 64) * 1e6
    pdl = None
    if tq.pdl_supported():  # the launch gap alone when the next launch need not wait for a flush
        pdl = graph_replay_s([lambda: _noop[(1,)](y, launch_pdl=True)] * 64) * 1e6
    return {"empty_kernel_us": plain, "empty_kernel_launch_pdl_us": pdl}


def summary(record: dict) -> None:
    for fmt, r in record["formats"].items():
        if "model" not in r:
            continue
        model = r["model"]
        print(f"== {fmt}: model chain ({model['gemvs']} GEMVs, {model['bytes'] / 1e6:.1f} MB)")
        for v, x in model["variants"].items():
            print(f"  {v:12s} {x['chain_us']:8.1f} us  {x['gbs']:7.0f} GB/s"
                  f"  {x['pct_of_copy']:5.1f}%"
                  f"  err {x['max_rel_err']:.1e}")
        for v, x in model.get("interleaved", {}).items():
            print(f"  {v:16s} {x['chain_us']:8.1f} us  {x['gbs']:7.0f} GB/s"
                  f"  {x['pct_of_copy']:5.1f}%  err {x['max_rel_err']:.1e}")
        for row in r["shapes"]:
            old = row["isolated_old_way"]
            line = " ".join(f"{v}={x['us_per_gemv']:.2f}us/{x['pct_of_copy']:.0f}%"
                            for v, x in row["variants"].items())
            print(f"  {row['shape']} isolated {old['us']:.2f}us/{old['pct_of_copy']:.0f}% | {line}")
    print(json.dumps({"copy_gbs": record["copy_gbs"], "errors": len(record["errors"])}))


def guarded(errors: list, where: str, fn):
    """fn() or None, the failure recorded: one part's failure does not end the run."""
    try:
        return fn()
    except Exception as exc:
        errors.append({"where": where, "error": repr(exc)[:400],
                       "trace": traceback.format_exc()[-1500:]})
        return None


def run_format(fmt: str, record: dict, out_dir: Path, quick: bool, do_sweep: bool, save) -> None:
    """Fills record["formats"][fmt], saving the record after every chain (a killed run keeps
    what it measured)."""
    errors, copy_gbs = record["errors"], record["copy_gbs"]
    r = record["formats"][fmt] = {}
    r["asm"] = guarded(errors, f"{fmt}/asm", lambda: asm_facts(fmt))
    r["graph_dot"] = guarded(errors, f"{fmt}/dot", lambda: graph_dot(fmt, out_dir))
    r["check"] = guarded(errors, f"{fmt}/check", lambda: check_fresh(fmt, errors)) or []
    bad = [c for c in r["check"] if not c["rel_err"] <= TOL]
    print(json.dumps({"fmt": fmt, "checked": len(r["check"]), "failed": bad[:5],
                      "asm": r["asm"], "dot": r["graph_dot"]}), flush=True)
    r["shapes"] = []
    for n, k in [] if quick else sorted({(n, k) for _, n, k in GDN + ATTN}):
        row = guarded(errors, f"{fmt}/{n}x{k}",
                      lambda n=n, k=k: shape_chain(fmt, n, k, copy_gbs, errors, do_sweep))
        if row:
            r["shapes"].append(row)
            print(json.dumps({"fmt": fmt, **{kk: v for kk, v in row.items() if kk != "sweep"}}),
                  flush=True)
            save()
    tuned = {tuple(row["shape"]): tuple(row["configs"]["tuned"])
             for row in r["shapes"] if "tuned" in row["configs"]}
    model = guarded(errors, f"{fmt}/model", lambda: model_chain(fmt, copy_gbs, errors, tuned))
    if model:
        r["model"] = model
        print(json.dumps({"fmt": fmt, "model": model}), flush=True)
        save()
    if r["shapes"] and model:
        r["shares"] = guarded(errors, f"{fmt}/shares", lambda: shares(model, r["shapes"]))


def pairs(text: str) -> list[tuple[int, int]]:
    """--sweep-shapes: "8:4,16:4" -> [(8, 4), (16, 4)] (powers of two), else an argparse error."""
    try:
        out = [(int(a), int(b)) for a, b in (p.split(":") for p in text.split(","))]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BLOCK_N:warps pairs, got {text!r}") from None
    if not out or any(v < 1 or v & (v - 1) for pair in out for v in pair):
        raise argparse.ArgumentTypeError(f"BLOCK_N and warps must be powers of two: {text!r}")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--quick", action="store_true", help="model chains only (no per-shape chains)")
    ap.add_argument("--sweep", action="store_true",
                    help="per shape, tile-mode PDL over SWEEP's configs; the best is 'tuned'")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="a subset, comma-separated (also: engine, TUNED_PDL's configs)")
    ap.add_argument("--sweep-shapes", default=None, type=pairs,
                    help="SWEEP's (BLOCK_N:warps) pairs, e.g. 8:4,16:4")
    ap.add_argument("--magic", default="", help="MAGIC values to sweep, e.g. 1,2")
    ap.add_argument("--sweep-pdl", default="tile", choices=("tile", "early"))
    ap.add_argument("--formats", default="int8,int4")
    args = ap.parse_args()
    FORMATS_RUN[:] = args.formats.split(",")
    VARIANTS[:] = [v for v in args.variants.split(",") if v]
    if args.sweep_shapes:
        SWEEP[:] = args.sweep_shapes
    SWEEP_MAGIC[:] = [int(v) for v in args.magic.split(",") if v]
    SWEEP_PDL[:] = [args.sweep_pdl]
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference F.linear in full fp32
    out_dir = Path(args.out).resolve().parent
    record = {"kind": "h200-qgemv-pdl-chain", "git_commit": git_commit(),
              "device": torch.cuda.get_device_name(),
              "capability": torch.cuda.get_device_capability(),
              "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
              "pdl_supported": tq.pdl_supported(), "variants": VARIANTS, "l2_bytes": L2_BYTES,
              "tuned": {str(k): v for k, v in tq.TUNED.items()},
              "tuned_pdl": {str(k): v for k, v in tq.TUNED_PDL.items()}, "errors": [], "formats": {},
              "sweep": {"pairs": SWEEP, "magic": SWEEP_MAGIC, "pdl": SWEEP_PDL[0]}}
    print(json.dumps({k: record[k] for k in ("device", "torch", "triton", "pdl_supported")}),
          flush=True)
    record["warm_cache"] = warm_cache(args.jobs, args.sweep)
    print(json.dumps(record["warm_cache"]), flush=True)
    record["gpu_before"] = gpu_state()
    record["copy_gbs"] = copy_bandwidth_gbs(torch.device("cuda"))
    record.update(empty_kernel_us())
    print(json.dumps({"copy_gbs": record["copy_gbs"], "empty_us": record["empty_kernel_us"],
                      "empty_pdl_us": record["empty_kernel_launch_pdl_us"]}), flush=True)
    def save():
        Path(args.out).write_text(json.dumps(record))

    for fmt in FORMATS_RUN:
        run_format(fmt, record, out_dir, args.quick, args.sweep, save)
        torch.cuda.empty_cache()
        save()
    record["copy_gbs_after"] = copy_bandwidth_gbs(torch.device("cuda"))
    record["gpu_after"] = gpu_state()
    Path(args.out).write_text(json.dumps(record))
    summary(record)


if __name__ == "__main__":
    main()
