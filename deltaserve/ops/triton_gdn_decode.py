"""GDN decode step on pool slots for CUDA GPUs (Triton): the contract of
ops/gdn_decode.gdn_decode_slots_ref in two kernels per layer.

1. delta: per (sequence, value head, block of 32 value columns) the causal conv of the head's q, k
   and that block of v channels (the window only read), SiLU, q/k L2 norms, decay and beta, the
   delta-rule update of those K x 32 columns of the recurrent matrix in place (fp32), and the raw
   output columns. 64 programs per sequence for the 0.8B shape: one program holding a head's whole
   128 x 128 matrix measured 10 us per layer on the H200 (16 programs, spilled registers).
2. out: per (sequence, value head) the gated RMSNorm over the head's V outputs, stored in the
   caller's dtype, and the conv-window shift of the head's channels (after every delta program has
   read the window: stream order, no race; q/k channels shifted by one owner per group).
Conv width 4 (every Qwen3.5 config); other widths take the torch reference (ops/gdn_decode).
"""

from __future__ import annotations

import torch

from deltaserve.ops.backend import pdl_args, tl, triton
from deltaserve.ops.backend import triton_enabled as available  # noqa: F401 (callers ask here)

BLOCK_V = 32  # value columns per program of the delta-rule kernel

if triton is not None:
    from deltaserve.ops.backend import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _conv_read(x_row, win, cw, cols, W: tl.constexpr):
        """SiLU of the causal conv (width 4: three window taps, then the new input) of channels
        `cols`, fp32; the window is only read here."""
        tl.static_assert(W == 4)
        base = win + cols * (W - 1)
        acc = tl.load(base).to(tl.float32) * tl.load(cw + cols * W)
        acc += tl.load(base + 1).to(tl.float32) * tl.load(cw + cols * W + 1)
        acc += tl.load(base + 2).to(tl.float32) * tl.load(cw + cols * W + 2)
        acc += tl.load(x_row + cols).to(tl.float32) * tl.load(cw + cols * W + 3)
        return acc / (1.0 + tl.exp(-acc))

    @triton.jit
    def _conv_shift(x_row, win, cols, W: tl.constexpr):
        """The window of channels `cols` moves one step: loads before the barrier, stores after
        (threads holding replicas of a channel must not read a tap another already moved)."""
        base = win + cols * (W - 1)
        t1 = tl.load(base + 1)
        t2 = tl.load(base + 2)
        x = tl.load(x_row + cols)
        tl.debug_barrier()
        tl.store(base, t1)
        tl.store(base + 1, t2)
        tl.store(base + 2, x.to(win.dtype.element_ty))

    @triton.jit
    def _delta_kernel(QKV, QKV_STRIDE, WIN, CW, A, B, AB_STRIDE, ALOG, DTB, STATE, SLOTS, O, C,
                      HV, GROUP, HK, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
                      BLOCK_V: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # programmatic dependent launch: wait for the predecessor's writes, let the
            gdc_wait()  # next kernel launch (and prefetch its static operands) meanwhile
            gdc_launch_dependents()
        b, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        kh = h // GROUP
        ks, vs = tl.arange(0, K), vb * BLOCK_V + tl.arange(0, BLOCK_V)
        slot = tl.load(SLOTS + b).to(tl.int64)
        x_row, win = QKV + b * QKV_STRIDE, WIN + slot * C * (W - 1)
        q = _conv_read(x_row, win, CW, kh * K + ks, W)
        k = _conv_read(x_row, win, CW, HK * K + kh * K + ks, W)
        v = _conv_read(x_row, win, CW, 2 * HK * K + h * V + vs, W)
        q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6) / tl.sqrt(K * 1.0)
        k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
        x = tl.load(A + b * AB_STRIDE + h).to(tl.float32) + tl.load(DTB + h)
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
        decay = tl.exp(-tl.exp(tl.load(ALOG + h)) * softplus)
        beta = 1.0 / (1.0 + tl.exp(-tl.load(B + b * AB_STRIDE + h).to(tl.float32)))
        ptrs = STATE + ((slot * HV + h) * K + ks[:, None]) * V + vs[None, :]
        s = tl.load(ptrs) * decay  # [K, BLOCK_V]
        delta = (v - tl.sum(s * k[:, None], 0)) * beta
        s += k[:, None] * delta[None, :]
        tl.debug_barrier()  # (as in _conv_shift: no replica stores before all have loaded)
        tl.store(ptrs, s)
        tl.store(O + (b * HV + h) * V + vs, tl.sum(s * q[:, None], 0))

    @triton.jit
    def _out_kernel(O, QKV, QKV_STRIDE, WIN, Z, Z_STRIDE, NW, SLOTS, OUT, OUT_STRIDE, C, HV,
                    GROUP, HK, eps, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # programmatic dependent launch: wait for the predecessor's writes, let the
            gdc_wait()  # next kernel launch (and prefetch its static operands) meanwhile
            gdc_launch_dependents()
        b, h = tl.program_id(0), tl.program_id(1)
        vs = tl.arange(0, V)
        # gated RMSNorm over the head's V outputs: rms_norm(o) * w * silu(z), plain w
        o = tl.load(O + (b * HV + h) * V + vs)
        o = o * tl.rsqrt(tl.sum(o * o, 0) / V + eps) * tl.load(NW + vs)
        z = tl.load(Z + b * Z_STRIDE + h * V + vs).to(tl.float32)
        tl.store(OUT + b * OUT_STRIDE + h * V + vs, (o * (z / (1.0 + tl.exp(-z)))).to(
            OUT.dtype.element_ty))
        # the conv windows move only now, after every delta program has read them
        slot = tl.load(SLOTS + b).to(tl.int64)
        x_row, win = QKV + b * QKV_STRIDE, WIN + slot * C * (W - 1)
        _conv_shift(x_row, win, 2 * HK * K + h * V + vs, W)
        if h % GROUP == 0:  # the key head's q/k channels: one owner per group
            ks = tl.arange(0, K)
            _conv_shift(x_row, win, (h // GROUP) * K + ks, W)
            _conv_shift(x_row, win, HK * K + (h // GROUP) * K + ks, W)


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
    block_v = min(BLOCK_V, v_dim)
    raw = torch.empty(bsz, num_heads * v_dim, dtype=torch.float32, device=qkv.device)
    _delta_kernel[(bsz, num_heads, v_dim // block_v)](
        qkv, qkv.stride(0), conv_pool, conv_w.float().contiguous(), a, b, a.stride(0),
        a_log.float().contiguous(), dt_bias.float().contiguous(), state_pool, slots, raw,
        channels, num_heads, group, num_k_heads, K=k_dim, V=v_dim, W=width, BLOCK_V=block_v,
        num_warps=4, **pdl_args())
    _out_kernel[(bsz, num_heads)](
        raw, qkv, qkv.stride(0), conv_pool, z, z.stride(0), norm_w.float().contiguous(), slots,
        out, out.stride(0), channels, num_heads, group, num_k_heads, eps, K=k_dim, V=v_dim,
        W=width, num_warps=4, **pdl_args())
    return out
