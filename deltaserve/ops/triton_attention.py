"""Gated attention of a decode step for CUDA GPUs (Triton), in three kernels per layer:

1. prep: per (token, head) the (1+w) RMSNorm of q or k, the partial rotary, and the K/V rows
   written into their paged-pool blocks (replaces ~10 torch ops: norms, slices, rotary, scatters).
2. paged attention, split over the key range (flash-decoding): per (sequence, kv head, split) the
   group's query heads against the blocks of the sequence's block table, online softmax in fp32;
   partial maxima, sums and outputs go to a small scratch.
3. combine: per (sequence, query head) the splits merged, times sigmoid(gate), stored in the
   activation dtype where o_proj reads it.
Contracts: ops/attention.qk_prep_ref and paged_decode_attention_ref
(tests/ops/test_triton_attention.py). Shapes: T tokens, B decode rows, HQ/HKV heads, D head dim,
R rotary dims, NB blocks of L positions.
"""

from __future__ import annotations

import torch

from deltaserve.ops.backend import pdl_args, tl, triton
from deltaserve.ops.backend import triton_enabled as available  # noqa: F401 (callers ask here)

SM_TARGET = 256  # programs to aim for when splitting the key range of few sequences

if triton is not None:
    from deltaserve.ops.backend import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _norm_rope(row, w, cos_row, sin_row, eps, ROUND: tl.constexpr, D: tl.constexpr,
                   R: tl.constexpr):
        """(1+w) RMSNorm of a head's D values (rounded to ROUND, as the norm's output is), then
        rotate-half on the first R dims in fp32."""
        d = tl.arange(0, D)
        x = tl.load(row + d).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
        y = (x * rstd * (tl.load(w + d).to(tl.float32) + 1.0)).to(ROUND).to(tl.float32)
        half: tl.constexpr = R // 2
        in_rot = d < R
        partner = tl.where(d < half, d + half, d - half)
        xp = tl.load(row + partner, mask=in_rot, other=0.0).to(tl.float32)
        wp = tl.load(w + partner, mask=in_rot, other=0.0).to(tl.float32)
        yp = (xp * rstd * (wp + 1.0)).to(ROUND).to(tl.float32)
        c = tl.load(cos_row + d, mask=in_rot, other=1.0).to(tl.float32)
        s = tl.load(sin_row + d, mask=in_rot, other=0.0).to(tl.float32)
        return tl.where(in_rot, y * c + tl.where(d < half, -yp, yp) * s, y)

    @triton.jit
    def _prep_kernel(P, P_STRIDE, QW, KW, COS, SIN, QOUT, KP, VP, BLOCKS, ROWS, HQ, HKV, eps,
                     D: tl.constexpr, R: tl.constexpr, L: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # programmatic dependent launch: wait for the predecessor's writes, let the
            gdc_wait()  # next kernel launch (and prefetch its static operands) meanwhile
            gdc_launch_dependents()
        t, h = tl.program_id(0), tl.program_id(1)
        row = P + t * P_STRIDE
        cos_row, sin_row = COS + t * R, SIN + t * R
        d = tl.arange(0, D)
        if h < HQ:  # query part of head h (its gate half stays where the combine reads it)
            y = _norm_rope(row + h * 2 * D, QW, cos_row, sin_row, eps, QOUT.dtype.element_ty, D, R)
            tl.store(QOUT + (t * HQ + h) * D + d, y.to(QOUT.dtype.element_ty))
        else:
            hk = h - HQ
            y = _norm_rope(row + 2 * HQ * D + hk * D, KW, cos_row, sin_row, eps,
                           QOUT.dtype.element_ty, D, R)
            blk = tl.load(BLOCKS + t).to(tl.int64)
            dst = ((blk * HKV + hk) * L + tl.load(ROWS + t)) * D + d
            tl.store(KP + dst, y.to(QOUT.dtype.element_ty).to(KP.dtype.element_ty))
            v = tl.load(row + 2 * HQ * D + HKV * D + hk * D + d)
            tl.store(VP + dst, v.to(VP.dtype.element_ty))

    @triton.jit
    def _paged_kernel(Q, KP, VP, TABLES, LENGTHS, MP, LP, AP, scale, NBMAX, HQ, HKV, SPLITS,
                      G: tl.constexpr, BLOCK_G: tl.constexpr, L: tl.constexpr, D: tl.constexpr,
                      IEEE: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # programmatic dependent launch: wait for the predecessor's writes, let the
            gdc_wait()  # next kernel launch (and prefetch its static operands) meanwhile
            gdc_launch_dependents()
        b, hk, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        length = tl.load(LENGTHS + b)
        num_blocks = tl.cdiv(length, L)
        per_split = tl.cdiv(num_blocks, SPLITS)
        start = sp * per_split
        end = tl.minimum(start + per_split, num_blocks)
        gs, ds, ls = tl.arange(0, BLOCK_G), tl.arange(0, D), tl.arange(0, L)
        g_ok = gs < G
        q = tl.load(Q + ((b * HQ + hk * G + gs[:, None]) * D + ds[None, :]), mask=g_ok[:, None],
                    other=0.0)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        den = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        for j in range(start, end):
            blk = tl.load(TABLES + b * NBMAX + j).to(tl.int64)
            base = (blk * HKV + hk) * L * D
            k = tl.load(KP + base + ls[:, None] * D + ds[None, :])
            if IEEE:
                s = tl.dot(q.to(k.dtype), tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q.to(k.dtype), tl.trans(k))
            s = tl.where((j * L + ls < length)[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            den = den * alpha + tl.sum(p, 1)
            v = tl.load(VP + base + ls[:, None] * D + ds[None, :])
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m = m_new
        heads = b * HQ + hk * G + gs
        tl.store(MP + heads * SPLITS + sp, m, mask=g_ok)
        tl.store(LP + heads * SPLITS + sp, den, mask=g_ok)
        tl.store(AP + (heads[:, None] * SPLITS + sp) * D + ds[None, :], acc, mask=g_ok[:, None])

    @triton.jit
    def _combine_kernel(MP, LP, AP, P, P_STRIDE, OUT, OUT_STRIDE, ROWS, HQ, SPLITS,
                        BLOCK_S: tl.constexpr, D: tl.constexpr, HAS_ROWS: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # programmatic dependent launch: wait for the predecessor's writes, let the
            gdc_wait()  # next kernel launch (and prefetch its static operands) meanwhile
            gdc_launch_dependents()
        b, h = tl.program_id(0), tl.program_id(1)
        sp, ds = tl.arange(0, BLOCK_S), tl.arange(0, D)
        ok = sp < SPLITS
        head = b * HQ + h
        m = tl.load(MP + head * SPLITS + sp, mask=ok, other=float("-inf"))
        den = tl.load(LP + head * SPLITS + sp, mask=ok, other=0.0)
        top = tl.max(m, 0)
        w = tl.where(ok & (m > float("-inf")), tl.exp(m - top), 0.0)
        acc = tl.load(AP + (head * SPLITS + sp[:, None]) * D + ds[None, :], mask=ok[:, None],
                      other=0.0)
        o = tl.sum(acc * w[:, None], 0) / tl.sum(den * w, 0)
        row = b
        if HAS_ROWS:
            row = tl.load(ROWS + b)
        gate = tl.load(P + row * P_STRIDE + h * 2 * D + D + ds).to(tl.float32)
        o = o / (1.0 + tl.exp(-gate))
        tl.store(OUT + row * OUT_STRIDE + h * D + ds, o.to(OUT.dtype.element_ty))


def qk_prep_cuda(proj: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 blocks: torch.Tensor, rows: torch.Tensor, num_heads: int, eps: float
                 ) -> torch.Tensor:
    """proj [T, P] (the q|gate, k, v projection, unit column stride) -> q [T, HQ, D] normed and
    rotated; k (normed, rotated) and v of token t written to block blocks[t], row rows[t]."""
    num_tokens = proj.shape[0]
    _, num_kv_heads, block_len, head_dim = k_pool.shape
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=proj.dtype, device=proj.device)
    _prep_kernel[(num_tokens, num_heads + num_kv_heads)](
        proj, proj.stride(0), q_w.contiguous(), k_w.contiguous(), cos.contiguous(),
        sin.contiguous(), q, k_pool, v_pool, blocks, rows, num_heads, num_kv_heads, eps,
        D=head_dim, R=cos.shape[-1], L=block_len, **pdl_args())
    return q


def num_splits(num_seqs: int, num_kv_heads: int, max_blocks: int) -> int:
    """Key-range splits per (sequence, kv head): enough programs to fill the GPU, never more
    splits than blocks."""
    want = max(1, SM_TARGET // max(1, num_seqs * num_kv_heads))
    return max(1, min(triton.next_power_of_2(want), max_blocks))


def paged_decode_attention_cuda(q: torch.Tensor, proj: torch.Tensor, k_pool: torch.Tensor,
                                v_pool: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor,
                                scale: float, out: torch.Tensor,
                                rows: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, HQ, D]; decode row b is token rows[b] (b itself when rows is None) and attends to
    its first lengths[b] positions through tables[b]. Writes attention * sigmoid(gate) (gate =
    the second half of each head's q|gate slice of proj) into out [T, HQ*D]."""
    bsz, width = tables.shape
    _, num_heads, head_dim = q.shape
    _, num_kv_heads, block_len, _ = k_pool.shape
    group = num_heads // num_kv_heads
    splits = num_splits(bsz, num_kv_heads, width)
    heads = bsz * num_heads * splits
    m_part = torch.empty(heads, dtype=torch.float32, device=q.device)
    l_part = torch.empty(heads, dtype=torch.float32, device=q.device)
    acc_part = torch.empty(heads, head_dim, dtype=torch.float32, device=q.device)
    q_rows = q if rows is None else q[rows]
    _paged_kernel[(bsz, num_kv_heads, splits)](
        q_rows, k_pool, v_pool, tables, lengths, m_part, l_part, acc_part, scale, width,
        num_heads, num_kv_heads, splits, G=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
        L=block_len, D=head_dim, IEEE=k_pool.dtype == torch.float32, num_warps=4, **pdl_args())
    _combine_kernel[(bsz, num_heads)](
        m_part, l_part, acc_part, proj, proj.stride(0), out, out.stride(0),
        tables if rows is None else rows, num_heads, splits,
        BLOCK_S=triton.next_power_of_2(splits), D=head_dim, HAS_ROWS=rows is not None,
        **pdl_args())
    return out
