"""The one Linear every model layer builds: dense weights now, quantized variants plug in here.

A Linear may pack several checkpoint projections that read the same input (q|k|v, gate|up, the GDN
in-projections) into one weight: one GEMM/GEMV instead of several, fewer passes over the input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.env import env
from deltaserve.ops import triton_gemv
from deltaserve.ops.dispatch import REFERENCE, Case, Op, case, rows_of, step_scratch
from deltaserve.ops.gemv import gemm_small, gemv
from deltaserve.ops.gemv_prologue import Prologue, apply_ref
from deltaserve.ops.native import native_lib

# From this many rows up a bf16/fp16 weight is widened once to the activation dtype and the GEMM runs
# there (CPUs without AMX run fp32 GEMMs ~1.6x faster than bf16). Below it each row is a GEMV that
# reads the narrow weight directly, since decode is bound by weight bytes.
WIDEN_MIN_ROWS = 4
# bf16 weights on CPU: up to this many rows (a decode batch) one native pass streams the weight once
# for all rows (ops/gemv.gemm_small); above it (prefill chunks) widening + the fp32 GEMM wins.
# Crossover timed on the 2-core Xeon when the kernel landed (8795cea; the timing script was never
# committed); the batch figures: docs/journal/2026-11-29-issue-5-batching.md.
SMALL_GEMM_MAX_ROWS = 128


class Linear(nn.Module):
    """y = x W^T with W [out, in] stored in `dtype`; x and y in the caller's activation dtype.

    `parts` names the checkpoint tensors packed row-wise into W (None = the module's own name).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int | list[int],
        dtype: torch.dtype,
        parts: list[str] | None = None,
    ) -> None:
        super().__init__()
        sizes = out_features if isinstance(out_features, list) else [out_features]
        self.in_features, self.out_sizes = in_features, sizes
        self.parts = parts
        self.weight = nn.Parameter(torch.empty(sum(sizes), in_features, dtype=dtype), False)
        # packed parts the checkpoint quantized differently (a GGUF's q|k|v with v in Q6_K, the
        # rest Q4_K): one quantized Linear per part, run in turn (quant.linear.quantize_parts_)
        self.segments: nn.ModuleList | None = None
        # x's columns gathered into the weight's column order first (int64 [in]): a GGUF's GDN
        # out-projection whose value heads are narrower than its blocks keeps the file's order
        self.input_order: nn.Parameter | None = None

    scheme = None  # a quant.schemes.Scheme once quant.linear.quantize_module_ has packed it
    # row-parallel under tensor parallelism: partial sums -> sums (distributed.sharded.attach)
    reduce = None

    def forward(self, x: torch.Tensor, prologue: Prologue | None = None) -> torch.Tensor:
        """prologue (ops/gemv_prologue): y = W f(x) for f = add + RMSNorm or silu * mul, fused into
        the decode GEMV where fuses_prologue(x) says so, else by the separate ops first."""
        if prologue is not None and not self.fuses_prologue(x):
            x, prologue = apply_ref(x, prologue), None
        if self.input_order is not None:
            x = x.index_select(-1, self.input_order)
        if self.segments is not None:
            y = torch.cat([segment(x) for segment in self.segments], dim=-1)
        elif self.scheme is not None:
            from deltaserve.quant.linear import quant_linear

            y = quant_linear(x, self, prologue)
        else:
            y = linear(x, self.weight, prologue)
        return y if self.reduce is None else self.reduce(y)

    def fuses_prologue(self, x: torch.Tensor) -> bool:
        """Whether this layer's GEMV for input row(s) x computes a prologue itself: one CUDA row on
        a Triton GEMV (dense: a tuned shape; packed: the layouts ops/triton_qgemv and
        ops/triton_q1 read), as the op's dispatch chose (DELTASERVE_GEMV_PROLOGUE=0: never)."""
        if not x.is_cuda or x.numel() != x.shape[-1] or not env().gemv_prologue or \
                self.segments is not None or self.input_order is not None:
            return False
        if self.scheme is None:
            return LINEAR.choose(linear_case(x, self.weight)).name == "triton_gemv"
        from deltaserve.quant.linear import QUANT_LINEAR, quant_case

        # not the K-quant GEMVs: their prologue computes x per strided load, and on an H100 the
        # 0.8B Q4_K_M decode ran 695 tok/s with it and 833 without (ops/triton_kquants)
        return QUANT_LINEAR.choose(quant_case(x, self)).name in ("triton_qgemv", "triton_q1_a8")

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.split(y, self.out_sizes, dim=-1)


def scratch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A view of the step's scratch arena (ops/dispatch.step_scratch), or a fresh tensor outside
    a step that carries one."""
    arena = step_scratch()
    if arena is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return arena.view(shape, dtype, device)


def widened(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`weight` converted into the scratch buffer."""
    out = scratch(tuple(weight.shape), dtype, weight.device)
    out.copy_(weight)
    return out


LINEAR = Op("linear", "y = x W^T for a dense weight (x in the activation dtype)",
            ("weight dtype", "one row", f"rows<={SMALL_GEMM_MAX_ROWS}", "contiguous", "tuned shape"))


def linear(x: torch.Tensor, weight: torch.Tensor, prologue: Prologue | None = None
           ) -> torch.Tensor:
    """prologue: only where Linear.fuses_prologue said so (a decode row on the Triton GEMV)."""
    impl = LINEAR.choose(linear_case(x, weight))
    if prologue is not None and impl.name != "triton_gemv":
        raise ValueError("linear: a GEMV prologue needs the Triton decode GEMV")
    return impl.fn(x, weight, prologue)


def linear_case(x: torch.Tensor, weight: torch.Tensor) -> Case:
    rows = rows_of(x)
    tuned = x.is_cuda and triton_gemv.config_for(weight.shape[0], weight.shape[1]) is not None
    return case(x, (weight.dtype, rows == 1, rows <= SMALL_GEMM_MAX_ROWS,
                    weight.is_contiguous(), tuned))


def _triton_why_not(c: Case) -> str | None:
    """A CUDA decode row on a 16-bit weight whose shape has a tuned Triton GEMV: only there did
    scripts/gpu/gemv_tune.py measure it beating cuBLAS (elsewhere F.linear stays)."""
    w_dtype, one_row, _, contiguous, tuned = c.shape
    if c.device != "cuda" or not one_row:
        return "not one CUDA row"
    if c.dtype != w_dtype or c.dtype not in (torch.bfloat16, torch.float16):
        return "not a 16-bit row on a weight of its dtype"
    if not (tuned and contiguous):
        return "no tuned Triton GEMV for this contiguous shape"
    return None if triton_gemv.available() else "the triton backend is off"


@LINEAR.register("triton_gemv", 40, _triton_why_not)
def _linear_triton(x, weight, prologue):
    out = triton_gemv.gemv16_cuda(x.reshape(1, x.shape[-1]), weight, prologue=prologue)
    return out.reshape(*x.shape[:-1], weight.shape[0])


@LINEAR.register("torch", 35, lambda c: None if c.dtype == c.shape[0] else
                 "the weight is narrower than the activations")
def _linear_torch(x, weight, prologue):
    return F.linear(x, weight)


def _cpu_narrow_why_not(c: Case, one_row: bool, native: bool) -> str | None:
    """CPU fp32 rows on a narrower weight (the torch verifier took equal dtypes), one row or a
    decode batch of 2..SMALL_GEMM_MAX_ROWS: a pass that streams the weight once, never widened
    (native: the bf16 kernels, a contiguous weight)."""
    w_dtype, single, small, contiguous, _ = c.shape
    if c.device != "cpu" or c.dtype != torch.float32:
        return "not CPU fp32 activations"
    if single != one_row or not small:
        return "not one row" if one_row else f"not 2..{SMALL_GEMM_MAX_ROWS} rows"
    if native and (w_dtype != torch.bfloat16 or not contiguous):
        return "not a contiguous bf16 weight"
    if native and native_lib() is None:
        return "no native kernels"
    return None


@LINEAR.register("native_gemv", 30, lambda c: _cpu_narrow_why_not(c, True, True))
def _linear_native_gemv(x, weight, prologue):
    return gemv(x.reshape(1, x.shape[-1]), weight).reshape(*x.shape[:-1], weight.shape[0])


@LINEAR.register("torch_narrow", 25, lambda c: _cpu_narrow_why_not(c, True, False))
def _linear_narrow(x, weight, prologue):
    """torch's own narrow GEMV: fast, but rounds x and y to the weight dtype."""
    flat = x.reshape(1, x.shape[-1])
    return F.linear(flat.to(weight.dtype), weight).float().reshape(*x.shape[:-1], weight.shape[0])


@LINEAR.register("native_gemm_small", 20, lambda c: _cpu_narrow_why_not(c, False, True))
def _linear_gemm_small(x, weight, prologue):
    out = gemm_small(x.reshape(-1, x.shape[-1]), weight)
    return out.reshape(*x.shape[:-1], weight.shape[0])


@LINEAR.register("widen", 10)
def _linear_widen(x, weight, prologue):
    """From WIDEN_MIN_ROWS rows (or off the narrow kernels) the weight widened once into the
    scratch buffer, then the activation dtype's GEMM."""
    return F.linear(x, widened(weight, x.dtype))


@LINEAR.register(REFERENCE, 0)
def _linear_reference(x, weight, prologue):
    return F.linear(x, weight if weight.dtype == x.dtype else weight.to(x.dtype))
