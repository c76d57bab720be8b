"""The whole GDN decode step after the in-projection, fused: conv window, q/k norms, decay, delta rule,
gated RMSNorm. The reference composes the prefill ops; the native kernel does it in one call."""

from __future__ import annotations

import ctypes

import torch

from deltaserve.ops.conv1d import causal_conv1d
from deltaserve.ops.dispatch import REFERENCE, Case, Op, case
from deltaserve.ops.gdn import gdn_gates, gdn_step
from deltaserve.ops.native import native_lib
from deltaserve.ops.norm import gated_rms_norm_ref


def gdn_decode_ref(
    qkv, z, b, a, window, conv_w, a_log, dt_bias, state, norm_w, eps: float, num_k_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [B,C]; z [B,HV*V]; b, a [B,HV]; window [B,C,W-1]; conv_w [C,W]; a_log, dt_bias [HV];
    state [B,HV,K,V] fp32 (updated in place); norm_w [V]. Returns (out [B,HV*V] fp32, new window)."""
    bsz, num_heads, k_dim, v_dim = state.shape
    conv, window = causal_conv1d(qkv.unsqueeze(1).float(), conv_w, window)
    q, k, v = torch.split(
        conv[:, 0], [num_k_heads * k_dim, num_k_heads * k_dim, num_heads * v_dim], -1
    )
    group = num_heads // num_k_heads
    q = q.reshape(bsz, num_k_heads, k_dim).repeat_interleave(group, 1)
    k = k.reshape(bsz, num_k_heads, k_dim).repeat_interleave(group, 1)
    g, beta = gdn_gates(a, b, a_log, dt_bias)
    o = gdn_step(q, k, v.reshape(bsz, num_heads, v_dim), g, beta, state, qk_l2norm=True)
    o = gated_rms_norm_ref(o, z.reshape(bsz, num_heads, v_dim), norm_w, eps)
    return o.reshape(bsz, -1), window


def gdn_decode_slots_ref(
    qkv, z, b, a, conv_pool, conv_w, a_log, dt_bias, state_pool, slots: torch.Tensor, norm_w,
    eps: float, num_k_heads: int,
) -> torch.Tensor:
    """gdn_decode_ref on rows `slots` [B] of the pools conv_pool [S,C,W-1] and state_pool
    [S,HV,K,V] (both updated in place). Returns out [B,HV*V] fp32."""
    state = state_pool[slots]
    out, window = gdn_decode_ref(qkv, z, b, a, conv_pool[slots], conv_w, a_log, dt_bias, state,
                                 norm_w, eps, num_k_heads)
    state_pool[slots] = state
    conv_pool[slots] = window.to(conv_pool.dtype)
    return out


GDN_DECODE = Op("gdn_decode", "GDN decode step on pool slots: conv window, qk norms, gates, "
                 "delta rule, gated norm", ("all fp32", "W", "K", "V"))


def gdn_decode_slots(
    qkv, z, b, a, conv_pool, conv_w, a_log, dt_bias, state_pool, slots: torch.Tensor, norm_w,
    eps: float, num_k_heads: int, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as gdn_decode_slots_ref; the native kernel (CPU) or the Triton kernel (CUDA)
    update the pool rows in place. With `out` [B, HV*V] (any float dtype) the result is written
    there (the Triton kernel stores it directly in out's dtype) and out is returned."""
    fp32 = all(t.dtype == torch.float32 for t in (qkv, z, b, a, conv_pool, conv_w, state_pool))
    c = case(qkv, (fp32, conv_pool.shape[-1] + 1, *state_pool.shape[-2:]))
    return GDN_DECODE(c, qkv, z, b, a, conv_pool, conv_w, a_log, dt_bias, state_pool, slots,
                      norm_w, eps, num_k_heads, out)


def _triton_why_not(c: Case) -> str | None:
    _, width, k_dim, v_dim = c.shape
    if c.device != "cuda":
        return "not a CUDA tensor"
    if width != 4 or k_dim & (k_dim - 1) or v_dim & (v_dim - 1):
        return "the kernels take width-4 convs and power-of-two head dims (tiled whole)"
    from deltaserve.ops.backend import triton_enabled

    return None if triton_enabled() else "the triton backend is off"


@GDN_DECODE.register("triton", 30, _triton_why_not)
def _gdn_decode_triton(*args):
    from deltaserve.ops import triton_gdn_decode

    return triton_gdn_decode.gdn_decode_slots_cuda(*args)


def _native_why_not(c: Case) -> str | None:
    if c.device != "cpu" or not c.shape[0]:
        return "not CPU fp32 tensors"
    return None if native_lib() is not None else "no native kernels"


@GDN_DECODE.register(REFERENCE, 0)
def _gdn_decode_torch(*args):
    *args, out = args
    result = gdn_decode_slots_ref(*args)
    return result if out is None else out.copy_(result)


@GDN_DECODE.register("native", 20, _native_why_not)
def _gdn_decode_native(qkv, z, b, a, conv_pool, conv_w, a_log, dt_bias, state_pool, slots,
                       norm_w, eps, num_k_heads, dest):
    """The C kernel on CPU fp32: every row's state and window updated in place."""
    lib = native_lib()
    fn = lib.ds_gdn_decode_slots
    if fn.argtypes is None:  # registered here: the signature lives beside its one caller
        fn.argtypes = [ctypes.c_void_p] * 12 + [ctypes.c_long] * 6 + [ctypes.c_float, ctypes.c_int]
        fn.restype = None
    _, num_heads, k_dim, v_dim = state_pool.shape
    slots = slots.to(torch.int64).contiguous()
    tensors = [t.contiguous() for t in (qkv, z, b, a)]
    params = [t.float().contiguous() for t in (conv_w, a_log, dt_bias, norm_w)]
    out = torch.empty(qkv.shape[0], num_heads * v_dim)
    ptrs = [t.data_ptr() for t in (*tensors, conv_pool)] + [params[0].data_ptr(),
            params[1].data_ptr(), params[2].data_ptr(), state_pool.data_ptr(),
            params[3].data_ptr(), out.data_ptr(), slots.data_ptr()]
    fn(*ptrs, qkv.shape[0], num_k_heads, num_heads, k_dim, v_dim, conv_w.shape[1], eps,
       torch.get_num_threads())
    return out if dest is None else dest.copy_(out)
