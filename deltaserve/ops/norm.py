"""RMSNorm over the last dim in fp32, with the (1+w) zero-centred weight convention as an offset."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.ops.dispatch import REFERENCE, Case, Op, case, rows_of
from deltaserve.ops.native import native_lib

NATIVE_MAX_ROWS = 8
# CUDA: decode-sized inputs (a step's sequences) and every 16-bit input take the one-kernel Triton
# norm; fp32 prefill keeps torch's reduction, the one transformers runs (fp32 parity margins).
CUDA_MAX_ROWS = 512


def cuda_kernel_rows(x: torch.Tensor) -> bool:
    """Whether a CUDA input of this many rows and this dtype takes the Triton elementwise kernels
    (norms, silu*mul, rotary, the attention prologue) rather than torch's ops."""
    return x.is_cuda and (rows_of(x) <= CUDA_MAX_ROWS or x.dtype != torch.float32)


def row_case(x: torch.Tensor) -> Case:
    """The Case of a row-wise op on x: its row count's class (native, CUDA kernel or neither)."""
    rows = rows_of(x)
    return case(x, (rows <= NATIVE_MAX_ROWS, rows <= CUDA_MAX_ROWS))


def triton_rows_why_not(c: Case) -> str | None:
    """The verifier of the Triton row-wise kernels (cuda_kernel_rows on a Case)."""
    if c.device != "cuda":
        return "not a CUDA tensor"
    if not c.shape[1] and c.dtype == torch.float32:
        return f"fp32 prefill over {CUDA_MAX_ROWS} rows keeps torch's reduction (fp32 parity)"
    from deltaserve.ops.backend import triton_enabled

    return None if triton_enabled() else "the triton backend is off"


def native_why_not(c: Case, any_rows: bool = False) -> str | None:
    """The verifier of the C row-wise kernels: CPU fp32, built; decode-sized rows (or any number
    in a step without prefill chunks, or with any_rows)."""
    if c.device != "cpu" or c.dtype != torch.float32:
        return "not a CPU fp32 tensor"
    if native_lib() is None:
        return "no native kernels (DELTASERVE_NATIVE=0 or no C compiler)"
    if not (any_rows or c.shape[0] or c.native_rows):
        # for prefill the torch op is as fast, and it is the very reduction transformers runs,
        # which keeps the fp32 comparison margin (0.8B: 6.6e-6 of 1e-5)
        return f"over {NATIVE_MAX_ROWS} rows in a step with prefill chunks"
    return None


ROWS = ("rows<=8", "rows<=512")  # row_case's shape
RMS_NORM = Op("rms_norm", "x * rsqrt(mean(x^2) + eps) * (w + offset) over the last dim", ROWS)
ADD_RMS_NORM = Op("add_rms_norm", "the pre-norm block seam: (rms_norm(residual + x), the sum)",
                  ROWS)
GATED_RMS_NORM = Op("gated_rms_norm", "GDN output norm: rms_norm(x) * w * silu(z)",
                    (*ROWS, "z dtype", "z takes CUDA kernels"))


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
    c = row_case(x)
    c = Case(c.device, c.dtype, (*c.shape, z.dtype, cuda_kernel_rows(z)), c.native_rows)
    return GATED_RMS_NORM(c, x, z, weight, eps, out_dtype)


def _gated_triton_why_not(c: Case) -> str | None:
    x_rows, z_dtype, z_rows = c.device == "cuda" and (c.shape[1] or c.dtype != torch.float32), \
        c.shape[2], c.shape[3]
    if not (x_rows or (z_dtype != torch.float32 and z_rows)):
        return "neither x nor a 16-bit z takes the CUDA kernel (cuda_kernel_rows)"
    return None if _triton_on() else "the triton backend is off"


@GATED_RMS_NORM.register("triton", 30, _gated_triton_why_not)
def _gated_rms_norm_triton(x, z, weight, eps, out_dtype):
    from deltaserve.ops import triton_norm

    return triton_norm.gated_rms_norm_cuda(x, z, weight, eps, out_dtype)


@GATED_RMS_NORM.register(REFERENCE, 0)
def _gated_rms_norm_torch(x, z, weight, eps, out_dtype):
    return gated_rms_norm_ref(x, z.reshape(x.shape), weight, eps).to(out_dtype)


def _triton_on() -> bool:
    from deltaserve.ops.backend import triton_enabled

    return triton_enabled()


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
    return ADD_RMS_NORM(row_case(x), x, residual, weight, eps, offset)


@ADD_RMS_NORM.register("triton", 30, triton_rows_why_not)
def _add_rms_norm_triton(x, residual, weight, eps, offset):
    from deltaserve.ops import triton_norm

    return triton_norm.add_rms_norm_cuda(x, residual, weight, eps, offset)


@ADD_RMS_NORM.register(REFERENCE, 0)
def _add_then_rms_norm(x, residual, weight, eps, offset):
    total = residual + x
    return rms_norm(total, weight, eps, offset), total


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """Same contract as rms_norm_ref: one native call on CPU fp32 (decode runs ~49 norms per
    token), one Triton kernel on CUDA (cuda_kernel_rows)."""
    return RMS_NORM(row_case(x), x, weight, eps, offset)


@RMS_NORM.register("triton", 30, triton_rows_why_not)
def _rms_norm_triton(x, weight, eps, offset):
    from deltaserve.ops import triton_norm

    return triton_norm.rms_norm_cuda(x, weight, eps, offset)


@RMS_NORM.register("native", 20, native_why_not)
def _rms_norm_native(x, weight, eps, offset):
    lib = native_lib()
    x = x.contiguous()
    w = weight.float().contiguous()
    out = torch.empty_like(x)
    dim = x.shape[-1]
    lib.ds_rmsnorm(x.data_ptr(), w.data_ptr(), out.data_ptr(), x.numel() // dim, dim, eps,
                   offset, torch.get_num_threads())
    return out


RMS_NORM.register(REFERENCE, 0)(rms_norm_ref)
