"""Decode GEMV: fp32 activations times bf16 weights, fp32 accumulation, each weight byte read once.

torch's bf16 GEMV on CPUs without AMX rounds activations and outputs to bf16 and streams weights at
~11 GB/s in the model; the native kernel (ops/csrc/gemv_bf16.c) reads them at ~25 GB/s and keeps the
math in fp32, so bf16 decode equals fp32 math on the bf16 weights.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from deltaserve.env import env
from deltaserve.ops.native import native_lib


def gemv_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M,K] fp32; weight [N,K] any float dtype -> [M,N] fp32. The spec."""
    return F.linear(x.float(), weight.float())


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [1,K] fp32 (CPU); weight [N,K] -> [1,N] fp32."""
    lib = native_lib()
    if env().reference_ops:
        return gemv_ref(x, weight)
    if lib is None or weight.dtype != torch.bfloat16 or not weight.is_contiguous():
        # torch's own narrow GEMV: fast, but rounds x and y to the weight dtype
        return F.linear(x.to(weight.dtype), weight).float()
    x = x.contiguous()
    out = torch.empty(1, weight.shape[0], dtype=torch.float32)
    lib.ds_gemv_bf16(
        weight.data_ptr(),
        x.data_ptr(),
        out.data_ptr(),
        weight.shape[0],
        weight.shape[1],
        torch.get_num_threads(),
    )
    return out


def gemm_small(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M,K] fp32 (CPU, small M: a decode batch); weight [N,K] bf16 -> [M,N] fp32, the weight
    streamed once for all M rows (ds_gemm_bf16), fp32 math as in gemv."""
    lib = native_lib()
    if env().reference_ops or lib is None or weight.dtype != torch.bfloat16 \
            or not weight.is_contiguous():
        return gemv_ref(x, weight)
    fn = lib.ds_gemm_bf16
    if fn.argtypes is None:  # registered beside its one caller
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [ctypes.c_int]
        fn.restype = None
    x = x.float().contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    fn(weight.data_ptr(), x.data_ptr(), out.data_ptr(), x.shape[0], weight.shape[0],
       weight.shape[1], torch.get_num_threads())
    return out
