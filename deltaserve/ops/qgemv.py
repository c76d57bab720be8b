"""Decode GEMV on quantized weights (CPU): the packed codes are read once, never widened to a
dense matrix. Native kernels (ops/csrc/gemv_quant.c) cover int8, 4-bit affine and q1, and
ops/csrc/gemv_blocks.c llama.cpp's block layouts (q4_k, q6_k, iq4_xs, ...); other layouts (MLX
8-bit affine, 2/3/5/6-bit) take the reference: dequantize, then F.linear.

int8 and 4-bit affine decode, where the library was built with AVX512-VNNI, quantize the
activation x to int8 per group of the weight's group size (64 in our format; symmetric, d =
absmax/127, round to nearest even) and run integer dot products: llama.cpp's Q8_0 x Q8_0 and
Q4_1 x Q8_1 semantics: W x^, x^ being x rounded per group. That is not
bit-comparable to dequantize-then-F.linear (rel-L2 ~0.6% on gaussian data), nor to machines
without VNNI; their exact reference is `qgemv_act_ref`.
DELTASERVE_EXACT_INT8_ACT=1 keeps fp32 activations (the exact kernels, as do groups that are not
a multiple of 64 or are over 512). An infinite x, or one near fp32's largest value, gives NaN on
these kernels (scale * step overflows), as on their references, where dequantize-then-F.linear
may give +-inf or a finite value.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from deltaserve.env import env
from deltaserve.ops import tuning
from deltaserve.ops.native import native_lib, simd_lanes
from deltaserve.quant.ggml_blocks import BLOCKS
from deltaserve.quant.schemes import Scheme, dequantize, unpack_codes


def qgemv_ref(x: torch.Tensor, p: dict, scheme: Scheme) -> torch.Tensor:
    """x [1,K] fp32, packed weight dict -> [1,N] fp32: dequantize-then-F.linear, the spec."""
    return F.linear(x.float(), dequantize(p, scheme, torch.float32))


def quantize_act(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [K] -> (xq int32 [K/G, G] in [-127, 127], dx fp32 [K/G]): the VNNI kernel's encoder."""
    xg = x.float().reshape(-1, group)
    d = xg.abs().amax(-1) / 127.0
    # x / d (as the kernel): a zero group stays zero instead of 0 * inf
    q = torch.where(d[:, None] > 0, xg / d[:, None], 0.0).round().clamp(-127, 127)
    return q.to(torch.int32), d


def qgemv_act_ref(x: torch.Tensor, p: dict, scheme: Scheme) -> torch.Tensor:
    """The int8-activation GEMVs' math in torch (int8 codes, 1-bit codes +-1 on x rounded per
    32, or 4-bit affine codes 0..15): per
    group, the exact integer dot of the codes and quantized x times scale * dx, plus (affine)
    bias times dx * sum(xq); summed over groups in fp32. x [1,K] -> [1,N] fp32."""
    n = p["weight"].shape[0]
    if scheme.kind == "q1":  # codes 2b - 1 (b: bit k % 8 of byte k / 8); x rounded per 32
        bits = (p["weight"].to(torch.int32).unsqueeze(-1) >> torch.arange(8)) & 1
        codes = (2 * bits.reshape(n, -1) - 1).reshape(n, -1, 32)
        xq, dx = quantize_act(x.reshape(-1), 32)
        per32 = (codes * xq).sum(-1).float() * dx  # [N, K/32]: exact dots times their dx
        group = per32.reshape(n, p["scales"].shape[-1], -1).sum(-1)
        return (group * p["scales"].float()).sum(-1).reshape(1, -1)
    xq, dx = quantize_act(x.reshape(-1), scheme.group_size)
    codes = p["weight"] if scheme.kind == "int8" else unpack_codes(p["weight"], scheme.bits)
    dots = (codes.to(torch.int32).reshape(n, *xq.shape) * xq).sum(-1)  # [N, K/G], exact in int32
    out = (dots.float() * (p["scales"].float() * dx)).sum(-1)
    if scheme.has_biases():
        out = out + (p["biases"].float() * (dx * xq.sum(-1).float())).sum(-1)
    return out.reshape(1, -1)


_NATIVE_KINDS = {("int8", 8): 0, ("affine", 4): 1, ("q1", 1): 2}  # ds_dequant's kind
# the same layouts' kernel stems (ds_gemv_q8, ...); the VNNI forms append "_vnni" (gemv_vnni.c)
_STEMS = {("int8", 8): "q8", ("affine", 4): "a4", ("q1", 1): "q1"}
# The kernels' scale_kind (ops/csrc/scales.h): the dtype the scales and biases are held in.
SCALE_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def scales_of(p: dict, scheme: Scheme) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(scales, biases (the scales where the scheme has none), scale_kind) for a native kernel,
    contiguous. The kernels read both in one dtype: a pair held in two dtypes (never the case
    after quant/linear.narrow_scales_) is widened to fp32 for the call, exactly."""
    s = p["scales"].contiguous()
    b = p["biases"].contiguous() if scheme.has_biases() else s
    if s.dtype != b.dtype or s.dtype not in SCALE_KINDS:
        s, b = s.float(), b.float()
    return s, b, SCALE_KINDS[s.dtype]


def dequantize_into(p: dict, scheme: Scheme, out: torch.Tensor) -> torch.Tensor:
    """The whole packed weight into `out` [N, K] fp32 (CPU): one native pass where a kernel
    covers the layout, else the reference dequantizer."""
    lib = native_lib()
    kind = _NATIVE_KINDS.get((scheme.kind, scheme.bits))
    if lib is not None and scheme.is_block() and out.device.type == "cpu":
        w = p["weight"].contiguous()
        lib.ds_dequant_blocks(BLOCKS[scheme.kind][0], w.data_ptr(), out.data_ptr(), out.shape[0],
                              out.shape[1], torch.get_num_threads())
        return out
    if lib is None or kind is None or out.device.type != "cpu":
        return out.copy_(dequantize(p, scheme, out.dtype))
    w = p["weight"].contiguous()
    s, b, scale_kind = scales_of(p, scheme)
    lib.ds_dequant(kind, w.data_ptr(), s.data_ptr(), b.data_ptr(), out.data_ptr(), out.shape[0],
                   out.shape[1], scheme.group_size, torch.get_num_threads(), scale_kind)
    return out


# Which int8 / 4-bit affine GEMV kernel won per (N, K) window [n_lo, n_hi) x [k_lo, k_hi), first
# match; shapes outside every window take VNNI. Data with provenance (record, commit, the two
# kernels' microseconds per shape): ops/tuning/cpu-qgemv-{int8,int4}.json, measured by
# `python scripts/cpu/qgemv_bench.py [--format int4] --out F` on the 2-core AVX512-VNNI Xeon.
# VNNI won every shape there (int8 cold 1.11-1.18x, int4 1.33-1.51x); the file is the place to send
# a window back to "exact" if a later kernel or machine says so.
_Q8_WINNERS = tuning.table("cpu-qgemv-int8")
_A4_WINNERS = tuning.table("cpu-qgemv-int4")


@functools.cache  # every decode GEMV asks; the answer per shape never changes
def vnni_wins(fmt: str, n: int, k: int) -> bool:
    """Whether the int8-activation kernel won this [n, k] shape for `fmt` ("int8" or "int4";
    formats without a table: yes)."""
    table = {"int8": _Q8_WINNERS, "int4": _A4_WINNERS}.get(fmt, {})
    for (n_lo, n_hi, k_lo, k_hi), name in table.items():
        if n_lo <= n < n_hi and k_lo <= k < k_hi:
            return name == "vnni"
    return True


def _vnni_allowed(lib, name: str, fmt: str, n: int, k: int, group: int) -> bool:
    """The int8-activation kernel `name` is built, allowed, takes this shape and won it."""
    if getattr(lib, name, None) is None or env().exact_int8_activations or k % group:
        return False
    if fmt == "int8" and group == 32:  # GGUF Q8_0: two groups per 64-byte chunk (block_vnni32)
        return k % 64 == 0 and vnni_wins(fmt, n, k)
    if group % 64 or group > 512:  # VNNI_MAX_G (gemv_vnni.c): larger groups take exact kernels
        return False
    return vnni_wins(fmt, n, k)


def q8_is_vnni(lib, n: int, k: int, group: int) -> bool:
    """Whether the int8 GEMV for this shape is the VNNI one (its multi-row and native-step forms
    follow the same choice, so every path gives a row the same bits)."""
    return _vnni_allowed(lib, "ds_gemv_q8_vnni", "int8", n, k, group)


def q1_is_vnni(lib, n: int, k: int, group: int) -> bool:
    """Whether the 1-bit GEMV for this shape is the VNNI one (no tuning table: it won every
    shape measured, docs/journal/2026-12-05-issue-34-gguf-quantized.md)."""
    return _vnni_allowed(lib, "ds_gemv_q1_vnni", "q1", n, k, group)


def a4_is_vnni(lib, n: int, k: int, group: int) -> bool:
    """Whether the 4-bit affine GEMV for this shape is the VNNI one (as q8_is_vnni)."""
    return _vnni_allowed(lib, "ds_gemv_a4_vnni", "int4", n, k, group)


def _kernel(lib, scheme: Scheme, n: int, k: int, multi: bool):
    """The native kernel for this weight: the GEMV (multi False) or the multi-row kernel that
    gives each row the GEMV's bits (None for q1, which has none); VNNI where q8_is_vnni /
    a4_is_vnni say so, so both forms always take the same one."""
    stem = _STEMS[(scheme.kind, scheme.bits)]
    if multi and stem == "q1":
        return None
    vnni = {"q8": q8_is_vnni, "a4": a4_is_vnni, "q1": q1_is_vnni}.get(stem)
    fast = vnni is not None and vnni(lib, n, k, scheme.group_size)
    fn = getattr(lib, f"ds_{'gemm' if multi else 'gemv'}_{stem}{'_vnni' if fast else ''}", None)
    if multi and fn is not None and fn.argtypes is None:  # registered beside its one caller
        num_ptrs = 5 if scheme.has_biases() else 4
        fn.argtypes = [ctypes.c_void_p] * num_ptrs + [ctypes.c_long] * 4 + [ctypes.c_int] * 2
        fn.restype = None
    return fn


# block kinds with an int8-activation kernel (gemv_blocks_vnni.c)
BLOCKS_VNNI = ("q4_k", "q5_k", "q6_k", "iq4_xs")


def blocks_act_ref(x: torch.Tensor, p: dict, scheme: Scheme) -> torch.Tensor:
    """The int8-activation block kernels' math: the exact weights times x rounded per group of
    32 to int8 steps (quantize_act). x [M,K] -> [M,N] fp32 (computed in fp64)."""
    rows = [xq.reshape(-1).double() * dx.double().repeat_interleave(32)
            for xq, dx in (quantize_act(r, 32) for r in x.float())]
    w = dequantize(p, scheme, torch.float32).double()
    return (torch.stack(rows) @ w.T).float()


def blocks_vnni(lib, scheme: Scheme) -> bool:
    """Whether a block layout's GEMM runs on int8 activations: built, not turned off
    (DELTASERVE_EXACT_INT8_ACT=1) and a kind with such a kernel. Every row count takes the same
    choice, so a row's bits never depend on its batch."""
    return scheme.kind in BLOCKS_VNNI and not env().exact_int8_activations and \
        getattr(lib, "ds_gemm_blocks_vnni", None) is not None


def gemm_blocks(x: torch.Tensor, p: dict, scheme: Scheme) -> torch.Tensor:
    """x [M,K] (M <= QGEMM_MAX_ROWS) -> [M,N] fp32 on a block layout's native kernel (exact
    fp32 activations: each block decoded once for all rows; or int8 activations where
    blocks_vnni says); a row gets the same bits whatever M is."""
    w, x = p["weight"].contiguous(), x.float().contiguous()
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
    lib = native_lib()
    args = (BLOCKS[scheme.kind][0], w.data_ptr(), x.data_ptr(), out.data_ptr(), x.shape[0],
            w.shape[0], x.shape[-1], torch.get_num_threads())
    if not (blocks_vnni(lib, scheme) and lib.ds_gemm_blocks_vnni(*args)):
        lib.ds_gemm_blocks(*args)
    return out


def qgemv(x: torch.Tensor, p: dict, scheme: Scheme) -> torch.Tensor:
    lib = native_lib()
    k = x.shape[-1]
    native = lib is not None and x.device.type == "cpu"
    if native and scheme.is_block():
        return gemm_blocks(x, p, scheme)
    if not native or (scheme.kind, scheme.bits) not in _STEMS:
        return qgemv_ref(x, p, scheme)
    w = p["weight"].contiguous()
    s, b, scale_kind = scales_of(p, scheme)
    x = x.float().contiguous()
    out = torch.empty(1, w.shape[0], dtype=torch.float32)
    biases = [b.data_ptr()] if scheme.has_biases() else []
    _kernel(lib, scheme, w.shape[0], k, multi=False)(
        w.data_ptr(), s.data_ptr(), *biases, x.data_ptr(), out.data_ptr(), w.shape[0], k,
        scheme.group_size, torch.get_num_threads(), scale_kind)
    return out


def _multi_row_kernel(lib, scheme: Scheme, n: int, k: int):
    """The multi-row kernel that gives each row its GEMV's bits for this weight: int8 and 4-bit
    affine (the VNNI or the exact fp32 one, as its GEMV); else None (q1, other layouts)."""
    if lib is None or (scheme.kind, scheme.bits) not in _STEMS:
        return None
    return _kernel(lib, scheme, n, k, multi=True)


def qgemm_rows(x: torch.Tensor, p: dict, scheme: Scheme) -> torch.Tensor | None:
    """x [M,K] fp32 (CPU, a few decode or draft rows) -> [M,N] fp32: the same bits as M qgemv
    calls, the packed codes streamed once for all rows (int8, 4-bit affine); None where no such
    kernel applies (then: a qgemv per row)."""
    w = p["weight"]
    if scheme.is_block() and x.device.type == "cpu" and native_lib() is not None:
        return gemm_blocks(x, p, scheme)
    multi = None if x.device.type != "cpu" else _multi_row_kernel(native_lib(), scheme,
                                                                  w.shape[0], x.shape[-1])
    if multi is None:
        return None
    w, x = w.contiguous(), x.float().contiguous()
    s, b, scale_kind = scales_of(p, scheme)
    biases = [b] if scheme.has_biases() else []
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
    multi(w.data_ptr(), s.data_ptr(), *[t.data_ptr() for t in biases], x.data_ptr(),
          out.data_ptr(), x.shape[0], w.shape[0], x.shape[-1], scheme.group_size,
          torch.get_num_threads(), scale_kind)
    return out


# Up to this many rows the multi-row kernels beat dequantize + the fp32 GEMM on the 0.8B shapes
# (2 threads; 16 / 32 / 64 rows, ms). int8: head 59.8 vs 176.4 / 126.3 vs 220.2 / 331.9 vs 339.7,
# gate|up 2.2 vs 4.9 / 4.3 vs 5.8 / 8.5 vs 7.8, down 1.0 vs 1.9 / 2.0 vs 2.4 / 4.0 vs 3.4.
# 4-bit affine (2026-11-30): head 81 vs 269 / 166 vs 281 (32 rows), gate|up 2.2 vs 4.5 / 4.8 vs
# 4.4 / 8.2 vs 5.8, down 1.1 vs 1.9 / 2.1 vs 1.8 / 4.7 vs 2.7: about even at 32. Exact int8 (fp32
# x): head 70 vs 219 / 129 vs 225, in_proj 1.8 vs 4.3 / 3.9 vs 4.9 / 7.5 vs 6.1, down 0.8 vs 1.5 /
# 1.6 vs 1.9 / 3.3 vs 2.4.
QGEMM_MAX_ROWS = 32


def qgemm_max_rows(scheme: Scheme, n: int, k: int) -> int:
    """How many CPU rows qgemm_rows takes for an [n, k] weight here (0: none, a GEMV per row).
    Without the kernels' vector paths a multi-row call costs what a GEMV per row costs: rows past
    quant/linear.CPU_GEMV_MAX_ROWS then take dequantize + torch's GEMM."""
    if scheme.is_block():  # one kernel for any number of rows
        return QGEMM_MAX_ROWS if native_lib() is not None else 0
    multi = _multi_row_kernel(native_lib(), scheme, n, k) is not None
    return QGEMM_MAX_ROWS if multi and simd_lanes() else 0
