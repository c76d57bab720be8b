"""The one Linear every model layer builds: dense weights now, quantized variants plug in here.

A Linear may pack several checkpoint projections that read the same input (q|k|v, gate|up, the GDN
in-projections) into one weight: one GEMM/GEMV instead of several, fewer passes over the input.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.env import env
from deltaserve.ops import triton_gemv, triton_qgemv
from deltaserve.ops.gemv import gemm_small, gemv
from deltaserve.ops.gemv_prologue import Prologue, apply_ref

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

    scheme = None  # a quant.schemes.Scheme once quant.linear.quantize_module_ has packed it
    # row-parallel under tensor parallelism: partial sums -> sums (distributed.sharded.attach)
    reduce = None

    def forward(self, x: torch.Tensor, prologue: Prologue | None = None) -> torch.Tensor:
        """prologue (ops/gemv_prologue): y = W f(x) for f = add + RMSNorm or silu * mul, fused into
        the decode GEMV where fuses_prologue(x) says so, else by the separate ops first."""
        if prologue is not None and not self.fuses_prologue(x):
            x, prologue = apply_ref(x, prologue), None
        if self.scheme is not None:
            from deltaserve.quant.linear import quant_linear

            y = quant_linear(x, self, prologue)
        else:
            y = linear(x, self.weight, prologue)
        return y if self.reduce is None else self.reduce(y)

    def fuses_prologue(self, x: torch.Tensor) -> bool:
        """Whether this layer's GEMV for input row(s) x computes a prologue itself: one CUDA row on
        a Triton GEMV (dense: a tuned shape; packed: every layout ops/triton_qgemv reads)."""
        if not x.is_cuda or x.numel() != x.shape[-1] or env().reference_ops \
                or not env().gemv_prologue:
            return False
        if self.scheme is None:
            return _triton_gemv(x, self.weight)
        from deltaserve.quant.linear import decode_gemv

        return decode_gemv(x, self.scheme) is triton_qgemv.qgemv_cuda

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.split(y, self.out_sizes, dim=-1)


MAX_SCRATCH_NUMEL = 64 * 1024 * 1024
_scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def scratch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A view of one reused buffer per (device, dtype): no fresh allocation (and page faults) per
    projection. Valid until the next call; the engine runs one forward at a time. Shapes over
    MAX_SCRATCH_NUMEL (e.g. an all-positions vocab head) get their own tensor: don't pin 1 GB."""
    numel = math.prod(shape)
    if numel > MAX_SCRATCH_NUMEL:
        return torch.empty(shape, dtype=dtype, device=device)
    key = (device, dtype)
    buf = _scratch.get(key)
    if buf is None or buf.numel() < numel:
        buf = _scratch[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel].view(shape)


def release_scratch() -> None:
    """Drop the scratch buffers (the server's idle unload frees the model's memory)."""
    _scratch.clear()


def widened(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`weight` converted into the scratch buffer."""
    out = scratch(tuple(weight.shape), dtype, weight.device)
    out.copy_(weight)
    return out


def _triton_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A CUDA decode row on a 16-bit weight whose shape has a tuned Triton GEMV: only there did
    scripts/gpu/gemv_tune.py measure it beating cuBLAS (elsewhere F.linear stays)."""
    return (x.numel() == x.shape[-1] and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16)
            and triton_gemv.config_for(weight.shape[0], weight.shape[1]) is not None
            and weight.is_contiguous() and not env().reference_ops and triton_gemv.available())


def linear(x: torch.Tensor, weight: torch.Tensor, prologue: Prologue | None = None
           ) -> torch.Tensor:
    """prologue: only where Linear.fuses_prologue said so (a decode row on the Triton GEMV)."""
    if x.device.type == "cuda" and _triton_gemv(x, weight):
        out = triton_gemv.gemv16_cuda(x.reshape(1, x.shape[-1]), weight, prologue=prologue)
        return out.reshape(*x.shape[:-1], weight.shape[0])
    if prologue is not None:
        raise ValueError("linear: a GEMV prologue needs the Triton decode GEMV")
    if weight.dtype == x.dtype:
        return F.linear(x, weight)
    rows = x.numel() // x.shape[-1]
    cpu_fp32 = x.device.type == "cpu" and x.dtype == torch.float32
    if not cpu_fp32 or rows > SMALL_GEMM_MAX_ROWS or (rows > 1 and weight.dtype != torch.bfloat16):
        return F.linear(x, widened(weight, x.dtype))
    flat = x.reshape(rows, x.shape[-1])
    out = gemv(flat, weight) if rows == 1 else gemm_small(flat, weight)
    return out.reshape(*x.shape[:-1], weight.shape[0])
