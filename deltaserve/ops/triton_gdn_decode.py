"""GDN decode step on pool slots for CUDA GPUs (Triton): the contract of
ops/gdn_decode.gdn_decode_slots_ref in one kernel per layer.

One program per (sequence, value head) holds the head's whole K x V recurrent matrix (128 x 128 fp32
across 8 warps) and does, in registers: the causal conv of the head's q, k and v channels with the
window shift in its pool slot, SiLU, the q/k L2 norms, decay and beta, the delta-rule update of the
matrix in place, the output row, the gated RMSNorm over it and the store in the caller's dtype.
Fusing the conv needs each program to own its q/k channels, i.e. one value head per key head
(Qwen3.5-0.8B and 2B); with grouped value heads the conv runs first as its own kernel, since the
programs of a group would race on the shared window. Conv width 4 (every Qwen3.5 config); other
widths take the torch reference (ops/gdn_decode).
"""

from __future__ import annotations

import torch

from deltaserve.ops.backend import tl, triton
from deltaserve.ops.backend import triton_enabled as available  # noqa: F401 (callers ask here)

NUM_WARPS = 8

if triton is not None:

    @triton.jit
    def _conv_taps(x_row, win, cw, cols, ok, W: tl.constexpr):
        """Causal conv of channels `cols` (width 4: three window taps, then the new input), the
        window shifted in place; returns SiLU of the sum in fp32. Every load comes before the
        barrier and every store after it: threads holding replicas of a channel (a vector
        narrower than the program's threads) would otherwise read a tap another already moved."""
        tl.static_assert(W == 4)
        base = win + cols * (W - 1)
        x = tl.load(x_row + cols, mask=ok, other=0.0)
        t0 = tl.load(base, mask=ok, other=0.0)
        t1 = tl.load(base + 1, mask=ok, other=0.0)
        t2 = tl.load(base + 2, mask=ok, other=0.0)
        acc = t0.to(tl.float32) * tl.load(cw + cols * W, mask=ok, other=0.0)
        acc += t1.to(tl.float32) * tl.load(cw + cols * W + 1, mask=ok, other=0.0)
        acc += t2.to(tl.float32) * tl.load(cw + cols * W + 2, mask=ok, other=0.0)
        acc += x.to(tl.float32) * tl.load(cw + cols * W + 3, mask=ok, other=0.0)
        tl.debug_barrier()
        tl.store(base, t1, mask=ok)
        tl.store(base + 1, t2, mask=ok)
        tl.store(base + 2, x.to(win.dtype.element_ty), mask=ok)
        return acc / (1.0 + tl.exp(-acc))

    @triton.jit
    def _conv_kernel(QKV, WIN, CW, SLOTS, OUT, C, QKV_STRIDE, W: tl.constexpr,
                     BLOCK_C: tl.constexpr):
        b = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        ok = cols < C
        slot = tl.load(SLOTS + b).to(tl.int64)
        out = _conv_taps(QKV + b * QKV_STRIDE, WIN + slot * C * (W - 1), CW, cols, ok, W)
        tl.store(OUT + b * C + cols, out, mask=ok)

    @triton.jit
    def _gdn_step_kernel(QKV, QKV_STRIDE, CONV, WIN, CW, Z, Z_STRIDE, A, B, AB_STRIDE, ALOG, DTB,
                         STATE, NW, SLOTS, OUT, OUT_STRIDE, C, HV, GROUP, HK, eps,
                         K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
                         FUSE_CONV: tl.constexpr):
        b, h = tl.program_id(0), tl.program_id(1)
        kh = h // GROUP
        ks, vs = tl.arange(0, K), tl.arange(0, V)
        slot = tl.load(SLOTS + b).to(tl.int64)
        if FUSE_CONV:
            x_row, win = QKV + b * QKV_STRIDE, WIN + slot * C * (W - 1)
            q = _conv_taps(x_row, win, CW, kh * K + ks, ks < K, W)
            k = _conv_taps(x_row, win, CW, HK * K + kh * K + ks, ks < K, W)
            v = _conv_taps(x_row, win, CW, 2 * HK * K + h * V + vs, vs < V, W)
        else:
            q = tl.load(CONV + b * C + kh * K + ks)
            k = tl.load(CONV + b * C + HK * K + kh * K + ks)
            v = tl.load(CONV + b * C + 2 * HK * K + h * V + vs)
        q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6) / tl.sqrt(K * 1.0)
        k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
        x = tl.load(A + b * AB_STRIDE + h).to(tl.float32) + tl.load(DTB + h)
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
        decay = tl.exp(-tl.exp(tl.load(ALOG + h)) * softplus)
        beta = 1.0 / (1.0 + tl.exp(-tl.load(B + b * AB_STRIDE + h).to(tl.float32)))
        ptrs = STATE + ((slot * HV + h) * K + ks[:, None]) * V + vs[None, :]
        s = tl.load(ptrs) * decay  # [K, V]
        delta = (v - tl.sum(s * k[:, None], 0)) * beta
        s += k[:, None] * delta[None, :]
        tl.debug_barrier()  # (as in the conv: no replica stores before all have loaded)
        tl.store(ptrs, s)
        o = tl.sum(s * q[:, None], 0)  # [V]
        # gated RMSNorm over the head's V outputs: rms_norm(o) * w * silu(z), plain w
        o = o * tl.rsqrt(tl.sum(o * o, 0) / V + eps) * tl.load(NW + vs)
        z = tl.load(Z + b * Z_STRIDE + h * V + vs).to(tl.float32)
        o = o * (z / (1.0 + tl.exp(-z)))
        tl.store(OUT + b * OUT_STRIDE + h * V + vs, o.to(OUT.dtype.element_ty))


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A [B, n] view readable in place: unit column stride (any row stride), else a copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def gdn_decode_slots_cuda(qkv, z, b, a, conv_pool, conv_w, a_log, dt_bias, state_pool,
                          slots: torch.Tensor, norm_w, eps: float, num_k_heads: int,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as ops/gdn_decode.gdn_decode_slots_ref (pools updated in place); the output
    [B, HV*V] goes to `out` (any dtype, unit column stride) when given, else a new fp32 tensor."""
    bsz, channels = qkv.shape
    _, num_heads, k_dim, v_dim = state_pool.shape
    width = conv_pool.shape[-1] + 1
    qkv, z, a, b = (_rows(t) for t in (qkv, z, a, b))
    if a.stride(0) != b.stride(0):
        a, b = a.contiguous(), b.contiguous()
    if out is None:
        out = torch.empty(bsz, num_heads * v_dim, dtype=torch.float32, device=qkv.device)
    group = num_heads // num_k_heads
    conv_w = conv_w.float().contiguous()
    conv = qkv  # unused when the conv is fused
    if group != 1:
        conv = torch.empty(bsz, channels, dtype=torch.float32, device=qkv.device)
        block_c = 256
        _conv_kernel[(bsz, triton.cdiv(channels, block_c))](
            qkv, conv_pool, conv_w, slots, conv, channels, qkv.stride(0), W=width,
            BLOCK_C=block_c)
    _gdn_step_kernel[(bsz, num_heads)](
        qkv, qkv.stride(0), conv, conv_pool, conv_w, z, z.stride(0), a, b, a.stride(0),
        a_log.float().contiguous(), dt_bias.float().contiguous(), state_pool,
        norm_w.float().contiguous(), slots, out, out.stride(0), channels, num_heads, group,
        num_k_heads, eps, K=k_dim, V=v_dim, W=width, FUSE_CONV=group == 1, num_warps=NUM_WARPS)
    return out
