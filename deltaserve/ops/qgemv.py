"""Decode GEMV on quantized weights (CPU): the packed codes are read once, never widened to a
dense matrix. Native kernels (ops/csrc/gemv_quant.c) cover int8, 4-bit affine and q1; other
layouts (MLX 8-bit affine, 2/3/5/6-bit) take the reference: dequantize, then F.linear."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.env import env
from deltaserve.ops.native import native_lib
from deltaserve.quant.schemes import Scheme, dequantize


def qgemv_ref(x: torch.Tensor, p: dict, scheme: Scheme) -> torch.Tensor:
    """x [1,K] fp32, packed weight dict -> [1,N] fp32: dequantize-then-F.linear, the spec."""
    return F.linear(x.float(), dequantize(p, scheme, torch.float32))


_NATIVE_KINDS = {("int8", 8): 0, ("affine", 4): 1, ("q1", 1): 2}


def dequantize_into(p: dict, scheme: Scheme, out: torch.Tensor) -> torch.Tensor:
    """The whole packed weight into `out` [N, K] fp32 (CPU): one native pass where a kernel
    covers the layout, else the reference dequantizer."""
    lib = native_lib()
    kind = _NATIVE_KINDS.get((scheme.kind, scheme.bits))
    if lib is None or kind is None or env().reference_ops or out.device.type != "cpu":
        return out.copy_(dequantize(p, scheme, out.dtype))
    w, s = p["weight"].contiguous(), p["scales"].contiguous()
    b = p["biases"].contiguous() if scheme.has_biases() else s
    lib.ds_dequant(kind, w.data_ptr(), s.data_ptr(), b.data_ptr(), out.data_ptr(), out.shape[0],
                   out.shape[1], scheme.group_size, torch.get_num_threads())
    return out


def qgemv(x: torch.Tensor, p: dict, scheme: Scheme) -> torch.Tensor:
    lib = native_lib()
    k = x.shape[-1]
    native = lib is not None and not env().reference_ops and x.device.type == "cpu"
    kind = (scheme.kind, scheme.bits)
    if not native or kind not in (("int8", 8), ("affine", 4), ("q1", 1)):
        return qgemv_ref(x, p, scheme)
    w, s = p["weight"].contiguous(), p["scales"].contiguous()
    x = x.float().contiguous()
    out = torch.empty(1, w.shape[0], dtype=torch.float32)
    args = (x.data_ptr(), out.data_ptr(), w.shape[0], k, scheme.group_size, torch.get_num_threads())
    if kind == ("int8", 8):
        lib.ds_gemv_q8(w.data_ptr(), s.data_ptr(), *args)
    elif kind == ("affine", 4):
        lib.ds_gemv_a4(w.data_ptr(), s.data_ptr(), p["biases"].contiguous().data_ptr(), *args)
    else:
        lib.ds_gemv_q1(w.data_ptr(), s.data_ptr(), *args)
    return out
