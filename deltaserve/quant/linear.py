"""Quantized Linear / embedding / head: packed weights in place of the dense `weight`.

A module becomes quantized on the meta device before it is materialised (`quantize_module_`): its
`weight` parameter is replaced by the packed codes, and `scales` (and `biases`) parameters appear,
all with the checkpoint's names, so a packed q|k|v Linear still loads by row slices. Scales are
loaded as fp32 (widened exactly from the file's fp16/bf16); `narrow_scales_` then stores them back
in the narrowest float that holds them exactly. The kernels (Triton on CUDA, ops/csrc on CPU)
widen them in registers, so a decode step reads half the scale bytes (int8: -2.9% of its bytes,
int4: -10%) for the same bits.

Prefill (>= WIDEN_MIN_ROWS rows) dequantizes the weight once per call, on CPU straight into the
shared scratch buffer with one native pass, and runs the dense GEMM; decode rows go to a native
GEMV that reads the packed codes (ops/qgemv.py on CPU, ops/triton_qgemv.py on CUDA GPUs).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.env import env
from deltaserve.layers.linear import WIDEN_MIN_ROWS, scratch
from deltaserve.ops import (
    dispatch,
    triton_blocks,
    triton_q1,
    triton_qgemm,
    triton_qgemv,
)
from deltaserve.ops.dispatch import REFERENCE, Case, Op, case, rows_of
from deltaserve.ops.qgemv import dequantize_into, qgemm_max_rows, qgemm_rows, qgemv
from deltaserve.quant.schemes import Scheme, dequantize

# CPU: up to this many rows (a decode batch) each row takes the packed-code GEMV; above it the weight
# is dequantized once and the fp32 GEMM runs. Measured on the 0.8B int8 shapes (2 threads): the
# vocabulary head 8 rows 114 ms vs 658 ms, 16 rows 340 vs 621, 32 rows 515 vs 544; the 7168-row
# gate|up 16 rows 4.2 vs 5.0 ms, 32 rows 8.4 vs 6.1 (docs/journal/2026-11-29-issue-5-batching.md).
CPU_GEMV_MAX_ROWS = 16
# In steps without prefill chunks (StepBatch.native_rows) int8 and 4-bit affine decode rows go
# further, up to ops/qgemv.QGEMM_MAX_ROWS, on the multi-row kernels; prefill chunks keep the limit
# above, so their numerics never depend on this.


def decode_max_rows(scheme: Scheme, n: int, k: int) -> int:
    """CPU rows of a step without prefill chunks that stay on the packed-code kernels (a GEMV per
    row, or the multi-row kernel that gives each row the same bits); more are dequantized for
    torch's GEMM. The native decode step (ops/decode_step.py) keeps to the same limit."""
    return max(CPU_GEMV_MAX_ROWS, qgemm_max_rows(scheme, n, k))


def quantize_module_(module: nn.Module, scheme: Scheme) -> None:
    """Swap `module.weight` [N, K] for packed parameters of `scheme` (shapes only; on meta)."""
    rows, cols = module.weight.shape
    scheme.check_cols(cols, type(module).__name__)
    device = module.weight.device
    del module.weight
    packed = torch.empty(scheme.packed_shape(rows, cols), dtype=scheme.packed_dtype(), device=device)
    module.weight = nn.Parameter(packed, False)
    module.scheme = scheme
    module.in_cols = cols
    if scheme.is_block():  # scales live inside the blocks
        return
    groups = (rows, cols // scheme.group_size)
    module.scales = nn.Parameter(torch.empty(groups, dtype=torch.float32, device=device), False)
    if scheme.has_biases():
        module.biases = nn.Parameter(torch.empty(groups, dtype=torch.float32, device=device), False)


def quantize_parts_(module: nn.Module, names: list[str], schemes: list[Scheme | None]) -> None:
    """A packed Linear whose parts the checkpoint quantized with different schemes (None: a float
    part): each part becomes its own Linear, quantized with its scheme (module.segments, loaded by
    checkpoint name `names[i]`), run in turn and concatenated; the packed weight goes. On meta,
    as quantize_module_."""
    from deltaserve.layers.linear import Linear

    device, dtype = module.weight.device, module.weight.dtype
    segments = nn.ModuleList()
    with torch.device(device):
        for name, size, scheme in zip(names, module.out_sizes, schemes, strict=True):
            segment = Linear(module.in_features, size, dtype)
            if scheme is not None:
                quantize_module_(segment, scheme)
            segment.checkpoint_name = name
            segments.append(segment)
    del module.weight
    module.segments = segments


def narrow_scales_(model: nn.Module) -> int:
    """Every quantized module's fp32 scales and biases as fp16, else bf16: the first of the two
    that holds every value of both exactly (the files store one of them), else both left fp32;
    one dtype per module, since the CPU kernels read both in one. Returns the number of tensors
    narrowed. After loading, on every device."""
    count = 0
    for module in model.modules():
        if not is_quantized(module) or module.scheme.is_block():
            continue
        names = [n for n in ("scales", "biases") if getattr(module, n, None) is not None]
        tensors = [getattr(module, n).data for n in names]
        if all(t.dtype in (torch.float16, torch.bfloat16) for t in tensors) \
                and len({t.dtype for t in tensors}) == 1:
            continue  # already narrowed
        tensors = [t.float() for t in tensors]  # a pair held in two dtypes: decided afresh
        for dtype in (torch.float16, torch.bfloat16):
            narrow = [t.to(dtype) for t in tensors]
            if all(_same_bits(n.float(), t) for n, t in zip(narrow, tensors, strict=True)):
                for name, n in zip(names, narrow, strict=True):
                    setattr(module, name, nn.Parameter(n, False))
                count += len(names)
                break
    return count


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality of two fp32 tensors: with denormals flushed (the CPU loader sets that) an fp32
    denormal compares equal to the 0.0 it narrows to, and -0.0 to 0.0; the bits do not."""
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def is_quantized(module: nn.Module) -> bool:
    return getattr(module, "scheme", None) is not None


def packed(module: nn.Module, rows: slice | torch.Tensor | None = None) -> dict:
    def sel(t: torch.Tensor) -> torch.Tensor:
        if rows is None:
            return t
        if t.dtype == torch.uint32:  # CUDA has no uint32 gather; the same bits as int32 do
            return t.view(torch.int32)[rows].view(torch.uint32)
        return t[rows]

    out = {"weight": sel(module.weight)}
    if module.scheme.is_block():
        return out
    out["scales"] = sel(module.scales)
    if module.scheme.has_biases():
        out["biases"] = sel(module.biases)
    return out


def row_view(module: nn.Module, start: int, end: int) -> SimpleNamespace:
    """A quantized module restricted to its output rows [start, end): the packed tensors it has
    (a block layout has no scales) and its scheme, for the kernels that take a module."""
    view = SimpleNamespace(scheme=module.scheme, in_cols=module.in_cols)
    for name in ("weight", "scales", "biases"):
        if getattr(module, name, None) is not None:
            setattr(view, name, getattr(module, name)[start:end])
    return view


def dequantized(module: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The whole weight in `dtype`: written straight into the shared scratch buffer on CPU fp32."""
    if dtype != torch.float32 or module.weight.device.type != "cpu":
        return dequantize(packed(module), module.scheme, dtype)
    out = scratch((module.weight.shape[0], module.in_cols), dtype, module.weight.device)
    return dequantize_into(packed(module), module.scheme, out)


QUANT_LINEAR = Op("quant_linear", "y = x W^T for a packed (int8 / 4-bit / 1-bit) weight",
                  ("scheme", "one row", "Triton GEMM rows", "packed GEMV rows"))


def quant_linear(x: torch.Tensor, module: nn.Module, prologue=None) -> torch.Tensor:
    """y = x W^T for a quantized module; x [..., K] in the activation dtype. prologue
    (ops/gemv_prologue): only where Linear.fuses_prologue said so (one row on the Triton GEMV)."""
    return QUANT_LINEAR(quant_case(x, module), x, module, prologue)


def quant_case(x: torch.Tensor, module: nn.Module) -> Case:
    """The case of x on this module: its scheme and row class (one row; a Triton GEMM batch; rows
    that stay on the packed-code GEMVs)."""
    rows = rows_of(x)
    max_rows = WIDEN_MIN_ROWS - 1
    if x.device.type == "cpu":  # decode-only steps: up to 32 int8 / int4 rows, multi-row kernels
        # (decode_max_rows is never under CPU_GEMV_MAX_ROWS: fewer rows need not ask)
        max_rows = decode_max_rows(module.scheme, module.weight.shape[0], module.in_cols) \
            if dispatch.native_rows() and rows > CPU_GEMV_MAX_ROWS else CPU_GEMV_MAX_ROWS
    return case(x, (module.scheme, rows == 1, 1 < rows <= triton_qgemm.MAX_ROWS,
                    rows <= max_rows))


def _triton_why_not(c: Case, rows_ok: bool, rows: str, kernel) -> str | None:
    """A Triton kernel module (supports(scheme), available()) for CUDA rows that rows_ok."""
    if c.device != "cuda" or not rows_ok:
        return rows
    if not kernel.supports(c.shape[0]):
        return "a layout the Triton kernel does not read"
    return None if kernel.available() else "the triton backend is off"


def _qgemm_why_not(c: Case) -> str | None:
    """A decode batch of rows on CUDA with int8 weights: the Triton GEMM that dequantizes in
    registers (ops/triton_qgemm) instead of a dequantized copy per step."""
    return _triton_why_not(c, c.shape[0].kind == "int8" and c.shape[2],
                           f"not 2..{triton_qgemm.MAX_ROWS} CUDA rows on int8 weights",
                           triton_qgemm)


@QUANT_LINEAR.register("triton_qgemm", 40, _qgemm_why_not)
def _quant_triton_qgemm(x, module, prologue):
    out = triton_qgemm.qgemm_cuda(x.reshape(-1, x.shape[-1]), packed(module), module.scheme)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _qgemv_why_not(c: Case) -> str | None:
    if c.shape[0].is_block():
        return "GGUF block kinds have no Triton GEMV: their blocks are decoded by torch"
    return _triton_why_not(c, c.shape[3], f"not up to {WIDEN_MIN_ROWS - 1} CUDA rows",
                           triton_qgemv)


@QUANT_LINEAR.register("triton_qgemv", 35, _qgemv_why_not)
def _quant_triton_qgemv(x, module, prologue):
    return _gemv_rows(triton_qgemv.qgemv_cuda, x, module, prologue)


def _gemv_rows(gemv, x, module, prologue):
    """A one-row Triton GEMV on x's rows: one call with the prologue fused, else one per row."""
    flat, p = x.reshape(-1, x.shape[-1]), packed(module)
    if prologue is not None:
        out = gemv(flat, p, module.scheme, prologue=prologue)
    else:
        out = _per_row(gemv, flat, p, module.scheme)
    return out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])


def _per_row(gemv, flat: torch.Tensor, p: dict, scheme) -> torch.Tensor:
    """gemv on each row of flat [R, K] (one row: no cat, which still costs a copy and ~12 us)."""
    if flat.shape[0] == 1:
        return gemv(flat, p, scheme)
    return torch.cat([gemv(flat[r : r + 1], p, scheme) for r in range(flat.shape[0])])


def _q1_a8_why_not(c: Case) -> str | None:
    """q1 rows on CUDA take int8 activations (ops/triton_q1: the CPU's and llama.cpp's Q1_0 math)
    unless DELTASERVE_EXACT_INT8_ACT=1 keeps fp32 x on the exact GEMV."""
    if c.shape[0].kind != "q1":
        return "not a q1 weight"
    if env().exact_int8_activations:
        return "DELTASERVE_EXACT_INT8_ACT=1: fp32 activations (the exact GEMV)"
    return _triton_why_not(c, c.shape[3], f"not up to {WIDEN_MIN_ROWS - 1} CUDA rows", triton_q1)


@QUANT_LINEAR.register("triton_q1_a8", 37, _q1_a8_why_not)
def _quant_triton_q1_a8(x, module, prologue):
    return _gemv_rows(triton_q1.q1_gemv_a8_cuda, x, module, prologue)


def _blocks_why_not(c: Case) -> str | None:
    if c.shape[0].kind not in triton_blocks.KINDS:
        return f"not a block kind with a Triton GEMV ({', '.join(triton_blocks.KINDS)})"
    return _triton_why_not(c, c.shape[3], f"not up to {WIDEN_MIN_ROWS - 1} CUDA rows",
                           triton_blocks)


@QUANT_LINEAR.register("triton_blocks", 36, _blocks_why_not)
def _quant_triton_blocks(x, module, prologue):
    """GGUF K-quant / IQ4_XS blocks read as they are (ops/triton_blocks.py), row by row (Q4_K and
    Q6_K by the word-wise kernels of ops/triton_kquants.py)."""
    flat = x.reshape(-1, x.shape[-1])
    out = triton_blocks.gemv_blocks_cuda(flat, module.weight, module.scheme.kind)
    return out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])


@QUANT_LINEAR.register("packed_gemv", 30, lambda c: None if c.device == "cpu"
                       and c.dtype == torch.float32 and c.shape[3] else
                       "not CPU fp32 rows within the packed-code GEMVs' row limit")
def _quant_packed_gemv(x, module, prologue):
    """CPU: the packed-code GEMV per row (fp32 x and y), or the multi-row kernel that gives each
    row the same bits in one pass over the codes."""
    flat, p = x.reshape(-1, x.shape[-1]).float(), packed(module)
    out = qgemm_rows(flat, p, module.scheme) if flat.shape[0] > 1 else None
    if out is None:
        out = _per_row(qgemv, flat, p, module.scheme)
    return out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])


@QUANT_LINEAR.register("dequantize_gemm", 10)
def _quant_dequantize_gemm(x, module, prologue):
    """The whole weight dequantized (into the shared scratch buffer on CPU fp32), torch's GEMM."""
    return F.linear(x, dequantized(module, x.dtype))


@QUANT_LINEAR.register(REFERENCE, 0)
def _quant_reference(x, module, prologue):
    return F.linear(x, dequantize(packed(module), module.scheme, x.dtype))


def embed(module: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Rows of a (possibly quantized) embedding table; quantized rows are dequantized alone, by the
    same function that dequantizes the whole table (so bit-identical to it)."""
    if not is_quantized(module):
        return F.embedding(ids, module.weight)
    flat = ids.reshape(-1)
    rows = dequantize(packed(module, flat), module.scheme, torch.float32)
    return rows.reshape(*ids.shape, rows.shape[-1])
