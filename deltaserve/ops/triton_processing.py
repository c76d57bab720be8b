"""Logits processing for CUDA GPUs (Triton): the processed rows copied out of the step's logits
with their grammar masks applied in one kernel, and the penalties' edits in one more, instead of
a dozen torch launches (each a few microseconds of a sub-millisecond decode step). Contracts:
ops/processing.mask_rows_ref and penalize_ref (tests/ops/test_triton_processing.py)."""

from __future__ import annotations

import torch

from deltaserve.ops.backend import tl, triton

BLOCK = 4096

if triton is not None:

    @triton.jit
    def _mask_rows_kernel(L, INDEX, MASK_OF, WORDS, OUT, V, L_ROW, W, BLOCK: tl.constexpr):
        p = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < V
        row = tl.load(INDEX + p).to(tl.int64)
        x = tl.load(L + row * L_ROW + cols, mask=ok, other=0.0).to(tl.float32)
        m = tl.load(MASK_OF + p).to(tl.int64)
        if m >= 0:
            w = tl.load(WORDS + m * W + cols // 32, mask=ok, other=0)
            bit = (w >> (cols % 32)) & 1
            x = tl.where(bit != 0, x, float("-inf"))
        tl.store(OUT + p.to(tl.int64) * V + cols, x, mask=ok)

    @triton.jit
    def _penalize_kernel(F, AT, R, C, E, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < E
        at = tl.load(AT + i, mask=ok, other=0).to(tl.int64)
        r = tl.load(R + i, mask=ok, other=1.0)
        c = tl.load(C + i, mask=ok, other=0.0)
        x = tl.load(F + at, mask=ok, other=0.0)
        tl.store(F + at, tl.where(x > 0, tl.math.div_rn(x, r), x * r) - c, mask=ok)

    @triton.jit
    def _pick_kernel(ROWS, INDEX, OUT, V, AT, BLOCK: tl.constexpr):
        # one program per row: a running (max, first index) over the row's blocks; a later
        # block wins only when strictly greater, so ties keep the first index (torch.argmax)
        p = tl.program_id(0)
        best = float("-inf")
        arg = 0
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(ROWS + p.to(tl.int64) * V + cols, mask=cols < V, other=float("-inf"))
            m, i = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
            if m > best:
                best = m
                arg = start + i
        tl.store(OUT + tl.load(INDEX + p).to(tl.int64), arg.to(tl.int64))
        tl.store(OUT + AT + p, (best > float("-inf")).to(tl.int64))

    @triton.jit
    def _mask_pick_kernel(L, INDEX, MASK_OF, WORDS, OUT, V, L_ROW, W, AT, FINITE_AT,
                          BLOCK: tl.constexpr):
        # _mask_rows_kernel and _pick_kernel in one program per row (the masked row is never
        # stored), plus whether every raw logit of the row is finite
        p = tl.program_id(0)
        row = tl.load(INDEX + p).to(tl.int64)
        m = tl.load(MASK_OF + p).to(tl.int64)
        best = float("-inf")
        arg = 0
        finite = 1
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < V
            x = tl.load(L + row * L_ROW + cols, mask=ok, other=0.0).to(tl.float32)
            bad = tl.sum(((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32), axis=0)
            finite = tl.where(bad > 0, 0, finite)
            x = tl.where(ok, x, float("-inf"))
            if m >= 0:
                w = tl.load(WORDS + m * W + cols // 32, mask=ok, other=0)
                x = tl.where(((w >> (cols % 32)) & 1) != 0, x, float("-inf"))
            mx, i = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
            if mx > best:
                best = mx
                arg = start + i
        tl.store(OUT + row, arg.to(tl.int64))
        tl.store(OUT + AT + p, (best > float("-inf")).to(tl.int64))
        tl.store(OUT + FINITE_AT + row, finite.to(tl.int64))


def mask_rows_cuda(logits: torch.Tensor, index: torch.Tensor, mask_of: torch.Tensor,
                   words: torch.Tensor) -> torch.Tensor:
    if logits.stride(-1) != 1 or not words.is_contiguous():
        raise ValueError("mask_rows_cuda needs unit inner strides")
    vocab = logits.shape[-1]
    out = torch.empty(index.shape[0], vocab, dtype=torch.float32, device=logits.device)
    grid = (index.shape[0], triton.cdiv(vocab, BLOCK))
    _mask_rows_kernel[grid](logits, index, mask_of, words, out, vocab, logits.stride(0),
                            words.shape[-1], BLOCK=BLOCK)
    return out


def penalize_cuda(rows: torch.Tensor, at: torch.Tensor, r: torch.Tensor, c: torch.Tensor) -> None:
    block = 256
    _penalize_kernel[(triton.cdiv(at.numel(), block),)](rows, at, r, c, at.numel(), BLOCK=block)


def pick_cuda(rows: torch.Tensor, index: torch.Tensor, out: torch.Tensor, at: int) -> None:
    if not rows.is_contiguous() or out.dtype != torch.int64:
        raise ValueError("pick_cuda needs contiguous fp32 rows and an int64 out")
    _pick_kernel[(rows.shape[0],)](rows, index, out, rows.shape[-1], at, BLOCK=BLOCK)


def mask_pick_cuda(logits: torch.Tensor, index: torch.Tensor, mask_of: torch.Tensor,
                   words: torch.Tensor, out: torch.Tensor, at: int, finite_at: int) -> None:
    if logits.stride(-1) != 1 or not words.is_contiguous() or out.dtype != torch.int64:
        raise ValueError("mask_pick_cuda needs unit inner strides and an int64 out")
    _mask_pick_kernel[(index.shape[0],)](logits, index, mask_of, words, out, logits.shape[-1],
                                         logits.stride(0), words.shape[-1], at, finite_at,
                                         BLOCK=BLOCK)
