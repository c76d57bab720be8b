"""Decode GEMV: fp32 activations times bf16 weights, fp32 accumulation, each weight byte read once.

torch's bf16 GEMV on CPUs without AMX rounds activations and outputs to bf16 and streams weights at
~11 GB/s in the model; the native kernel (ops/csrc/gemv_bf16.c) reads them at ~25 GB/s and keeps the
math in fp32, so bf16 decode equals fp32 math on the bf16 weights.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from deltaserve.ops.native import native_lib


def gemv_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M,K] fp32; weight [N,K] any float dtype -> [M,N] fp32. The spec."""
    return F.linear(x.float(), weight.float())


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [1,K] fp32 (CPU); weight [N,K] bf16 contiguous -> [1,N] fp32 (the native kernel: its
    dispatch, layers/linear.LINEAR, checked it is built)."""
    lib = native_lib()
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
    """x [M,K] fp32 (CPU, small M: a decode batch); weight [N,K] bf16 contiguous -> [M,N] fp32,
    the weight streamed once for all M rows (ds_gemm_bf16), fp32 math as in gemv."""
    fn = native_lib().ds_gemm_bf16
    if fn.argtypes is None:  # registered beside its one caller
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [ctypes.c_int]
        fn.restype = None
    x = x.float().contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    fn(weight.data_ptr(), x.data_ptr(), out.data_ptr(), x.shape[0], weight.shape[0],
       weight.shape[1], torch.get_num_threads())
    return out
