"""GDN decode step on pool slots for CUDA GPUs (Triton): the contract of
ops/gdn_decode.gdn_decode_slots_ref, in two kernels instead of a gather, ~12 torch ops and a scatter.

1. conv: per (sequence, channel block) the causal conv tap sum, SiLU, and the window shift, read
   from and written back to the sequence's slot of the conv pool.
2. delta rule: per (sequence, value head, block of V columns) the q/k L2 norms, decay and beta, and
   the update of those columns of the recurrent matrix in place in its pool slot (fp32).
The gated RMSNorm over each head's V outputs then runs as one more kernel (it needs all of V).
"""

from __future__ import annotations

import torch

from deltaserve.ops.backend import tl, triton
from deltaserve.ops.backend import triton_enabled as available  # noqa: F401 (callers ask here)
from deltaserve.ops.triton_norm import gated_rms_norm_cuda

if triton is not None:

    @triton.jit
    def _conv_kernel(QKV, WIN, CW, SLOTS, OUT, C, QKV_STRIDE, W: tl.constexpr,
                     BLOCK_C: tl.constexpr):
        b = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        ok = cols < C
        slot = tl.load(SLOTS + b)
        win = WIN + slot * C * (W - 1) + cols * (W - 1)
        x = tl.load(QKV + b * QKV_STRIDE + cols, mask=ok, other=0.0).to(tl.float32)
        acc = x * tl.load(CW + cols * W + (W - 1), mask=ok, other=0.0)
        prev = tl.load(win, mask=ok, other=0.0).to(tl.float32)  # tap 0
        acc += prev * tl.load(CW + cols * W, mask=ok, other=0.0)
        for t in tl.static_range(1, W - 1):
            cur = tl.load(win + t, mask=ok, other=0.0)
            acc += cur.to(tl.float32) * tl.load(CW + cols * W + t, mask=ok, other=0.0)
            tl.store(win + t - 1, cur, mask=ok)  # shift left by one
        tl.store(win + (W - 2), x.to(WIN.dtype.element_ty), mask=ok)
        tl.store(OUT + b * C + cols, acc / (1.0 + tl.exp(-acc)), mask=ok)

    @triton.jit
    def _delta_kernel(CONV, A, B, ALOG, DTB, STATE, SLOTS, OUT, C, HV, GROUP, HK, AB_STRIDE,
                      K: tl.constexpr, V: tl.constexpr, BLOCK_V: tl.constexpr):
        b, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        kh = h // GROUP
        ks = tl.arange(0, K)
        vs = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        q = tl.load(CONV + b * C + kh * K + ks)
        k = tl.load(CONV + b * C + HK * K + kh * K + ks)
        v = tl.load(CONV + b * C + 2 * HK * K + h * V + vs)
        q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6) / tl.sqrt(K * 1.0)
        k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
        x = tl.load(A + b * AB_STRIDE + h).to(tl.float32) + tl.load(DTB + h)
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
        decay = tl.exp(-tl.exp(tl.load(ALOG + h)) * softplus)
        beta = 1.0 / (1.0 + tl.exp(-tl.load(B + b * AB_STRIDE + h).to(tl.float32)))
        slot = tl.load(SLOTS + b)
        ptrs = STATE + ((slot * HV + h) * K + ks[:, None]) * V + vs[None, :]
        s = tl.load(ptrs) * decay  # [K, BLOCK_V]
        delta = (v - tl.sum(s * k[:, None], 0)) * beta
        s += k[:, None] * delta[None, :]
        tl.store(ptrs, s)
        tl.store(OUT + (b * HV + h) * V + vs, tl.sum(s * q[:, None], 0))


def gdn_decode_slots_cuda(qkv, z, b, a, conv_pool, conv_w, a_log, dt_bias, state_pool,
                          slots: torch.Tensor, norm_w, eps: float, num_k_heads: int) -> torch.Tensor:
    """Same contract as ops/gdn_decode.gdn_decode_slots_ref (pools updated in place)."""
    bsz, channels = qkv.shape
    _, num_heads, k_dim, v_dim = state_pool.shape
    width = conv_pool.shape[-1] + 1
    # row views of the in-projection output are read in place (unit column stride, any row stride)
    qkv, a, b = (t if t.stride(-1) == 1 else t.contiguous() for t in (qkv, a, b))
    if a.stride(0) != b.stride(0):
        a, b = a.contiguous(), b.contiguous()
    conv = torch.empty(bsz, channels, dtype=torch.float32, device=qkv.device)
    block_c = 256
    _conv_kernel[(bsz, triton.cdiv(channels, block_c))](
        qkv, conv_pool, conv_w.float().contiguous(), slots, conv, channels, qkv.stride(0),
        W=width, BLOCK_C=block_c)
    out = torch.empty(bsz, num_heads, v_dim, dtype=torch.float32, device=qkv.device)
    block_v = 32
    _delta_kernel[(bsz, num_heads, v_dim // block_v)](
        conv, a, b, a_log.float().contiguous(), dt_bias.float().contiguous(), state_pool, slots,
        out, channels, num_heads, num_heads // num_k_heads, num_k_heads, a.stride(0), K=k_dim,
        V=v_dim, BLOCK_V=block_v, num_warps=4)
    o = gated_rms_norm_cuda(out, z, norm_w, eps)
    return o.reshape(bsz, -1)
