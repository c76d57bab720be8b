"""RMSNorm over the last dim in fp32, with the (1+w) zero-centred weight convention as an offset."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from deltaserve.env import env
from deltaserve.ops.native import native_lib

NATIVE_MAX_ROWS = 8
# Steps without prefill chunks (decodes, draft verification) take the native norm at any row count:
# its rows are independent of each other, so a row's bits never depend on how many rows share
# its step (spec/rollback.py relies on it). Set by the model runner around such forwards.
_all_rows_native = [False]


def all_rows_native() -> bool:
    """Whether the caller is within native_rows (a step without prefill chunks)."""
    return _all_rows_native[0]


@contextlib.contextmanager
def native_rows(enabled: bool = True):
    """Within: CPU fp32 rms_norm calls run natively whatever their row count."""
    before, _all_rows_native[0] = _all_rows_native[0], enabled
    try:
        yield
    finally:
        _all_rows_native[0] = before
# CUDA: decode-sized inputs (a step's sequences) and every 16-bit input take the one-kernel Triton
# norm; fp32 prefill keeps torch's reduction, the one transformers runs (fp32 parity margins).
CUDA_MAX_ROWS = 512


def cuda_kernel_rows(x: torch.Tensor) -> bool:
    """Whether a CUDA input of this many rows and this dtype takes the Triton elementwise kernels
    (norms, silu*mul, rotary, the attention prologue) rather than torch's ops."""
    rows = x.numel() // x.shape[-1]
    return x.is_cuda and (rows <= CUDA_MAX_ROWS or x.dtype != torch.float32) \
        and not env().reference_ops


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """x [..., N] -> x * rsqrt(mean(x^2) + eps) * (w + offset), computed in fp32, returned in x.dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (weight.float() + offset)).to(x.dtype)


def gated_rms_norm_ref(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """GDN output norm: rms_norm(x) * w * silu(z) in fp32 (plain w, norm before gate); returns fp32."""
    return rms_norm_ref(x.float(), weight, eps, 0.0) * F.silu(z.float())


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                   out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """gated_rms_norm_ref(x, z).to(out_dtype): one Triton kernel on CUDA (as cuda_kernel_rows, or
    any row count when z, the projection output, is 16-bit: the scan's fp32 output of a bf16 model
    is not an fp32 model). z may also be [R, G*N] rows of G heads (a projection's view)."""
    if cuda_kernel_rows(x) or (z.dtype != torch.float32 and cuda_kernel_rows(z)):
        from deltaserve.ops import triton_norm

        if triton_norm.available():
            return triton_norm.gated_rms_norm_cuda(x, z, weight, eps, out_dtype)
    return gated_rms_norm_ref(x, z.reshape(x.shape), weight, eps).to(out_dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-norm block seam: total = residual + x (in residual's dtype), returns
    (rms_norm_ref(total), total)."""
    total = residual + x
    return rms_norm_ref(total, weight, eps, offset), total


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as add_rms_norm_ref: one Triton kernel for decode-sized CUDA inputs, else the
    add and rms_norm (native on CPU)."""
    if cuda_kernel_rows(x):
        from deltaserve.ops import triton_norm

        if triton_norm.available():
            return triton_norm.add_rms_norm_cuda(x, residual, weight, eps, offset)
    total = residual + x
    return rms_norm(total, weight, eps, offset), total


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """Same contract as rms_norm_ref: one native call on CPU fp32 (decode runs ~49 norms per token)."""
    lib = native_lib()
    rows = x.numel() // x.shape[-1]
    if cuda_kernel_rows(x):
        from deltaserve.ops import triton_norm

        if triton_norm.available():
            return triton_norm.rms_norm_cuda(x, weight, eps, offset)
    # Only decode-sized inputs: for prefill the torch op is as fast, and it is the very reduction
    # transformers runs, which keeps the fp32 comparison margin (0.8B: 6.6e-6 of 1e-5).
    if (
        lib is None
        or env().reference_ops
        or (rows > NATIVE_MAX_ROWS and not _all_rows_native[0])
        or x.device.type != "cpu"
        or x.dtype != torch.float32
    ):
        return rms_norm_ref(x, weight, eps, offset)
    x = x.contiguous()
    w = weight.float().contiguous()
    out = torch.empty_like(x)
    dim = x.shape[-1]
    lib.ds_rmsnorm(
        x.data_ptr(),
        w.data_ptr(),
        out.data_ptr(),
        x.numel() // dim,
        dim,
        eps,
        offset,
        torch.get_num_threads(),
    )
    return out
