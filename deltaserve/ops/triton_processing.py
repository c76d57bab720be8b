"""Logits processing for CUDA GPUs (Triton): the processed rows copied out of the step's logits
with their grammar masks applied in one kernel, and the penalties' edits in one more, instead of
a dozen torch launches (each a few microseconds of a sub-millisecond decode step). Contracts:
ops/processing.mask_rows_ref and penalize_ref (tests/ops/test_triton_processing.py)."""

from __future__ import annotations

import torch

from deltaserve.ops.backend import tl, triton

BLOCK = 4096
# columns per program of the pick: 2048 makes 122 programs of a 248k row, enough to fill an
# H100's 132 multiprocessors at batch 1 (a program per row left all but one idle)
PICK_BLOCK = 2048

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
    def _pick_part_kernel(L, INDEX, MASK_OF, WORDS, PART, V, L_ROW, W, S,
                          GATHER: tl.constexpr, MASKED: tl.constexpr, BLOCK: tl.constexpr):
        # program (p, s): the best (value, first index) of row p's s-th block of columns and
        # whether its raw logits are all finite, into PART [3, P, S] (value, index, finite)
        p = tl.program_id(0)
        s = tl.program_id(1)
        row = p.to(tl.int64)
        if GATHER:
            row = tl.load(INDEX + p).to(tl.int64)
        cols = s * BLOCK + tl.arange(0, BLOCK)
        ok = cols < V
        x = tl.load(L + row * L_ROW + cols, mask=ok, other=0.0).to(tl.float32)
        bad = tl.sum(((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32), axis=0)
        x = tl.where(ok, x, float("-inf"))
        if MASKED:
            m = tl.load(MASK_OF + p).to(tl.int64)
            if m >= 0:
                w = tl.load(WORDS + m * W + cols // 32, mask=ok, other=0)
                x = tl.where(((w >> (cols % 32)) & 1) != 0, x, float("-inf"))
        mx, i = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        at = p * S + s
        n = tl.num_programs(0) * S
        tl.store(PART + at, mx.to(tl.int32, bitcast=True))
        tl.store(PART + n + at, s * BLOCK + i)
        tl.store(PART + 2 * n + at, (bad == 0).to(tl.int32))

    @triton.jit
    def _pick_done_kernel(PART, INDEX, OUT, P, S, AT, FINITE_AT, FINITE: tl.constexpr,
                          SB: tl.constexpr):
        # row p's token: the first block holding its maximum (blocks ascend, so ties keep the
        # first index, as torch.argmax), "a token was allowed" and its finite flag
        p = tl.program_id(0)
        k = tl.arange(0, SB)
        ok = k < S
        n = P * S
        v = tl.load(PART + p * S + k, mask=ok, other=0).to(tl.float32, bitcast=True)
        v = tl.where(ok, v, float("-inf"))
        best, kb = tl.max(v, axis=0, return_indices=True, return_indices_tie_break_left=True)
        arg = tl.load(PART + n + p * S + kb)
        row = tl.load(INDEX + p).to(tl.int64)
        tl.store(OUT + row, arg.to(tl.int64))
        tl.store(OUT + AT + p, (best > float("-inf")).to(tl.int64))
        if FINITE:
            fin = tl.min(tl.load(PART + 2 * n + p * S + k, mask=ok, other=1), axis=0)
            tl.store(OUT + FINITE_AT + row, fin.to(tl.int64))


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
    _pick(rows, index, None, None, out, at, None)


def mask_pick_cuda(logits: torch.Tensor, index: torch.Tensor, mask_of: torch.Tensor,
                   words: torch.Tensor, out: torch.Tensor, at: int, finite_at: int) -> None:
    if logits.stride(-1) != 1 or not words.is_contiguous() or out.dtype != torch.int64:
        raise ValueError("mask_pick_cuda needs unit inner strides and an int64 out")
    _pick(logits, index, mask_of, words, out, at, finite_at)


def _pick(table, index, mask_of, words, out, at, finite_at) -> None:
    """The greedy pick split over PICK_BLOCK-column blocks of each row, then one small program
    per row over its blocks' bests: one program per row looped over a 248k vocabulary for
    ~130 us on an H100 at batch 1, longer than the rest of the processing together."""
    num, vocab = index.shape[0], table.shape[-1]
    splits = triton.cdiv(vocab, PICK_BLOCK)
    part = _scratch(table.device, 3 * num * splits)
    gather = mask_of is not None
    _pick_part_kernel[(num, splits)](
        table, index, mask_of if gather else index, words if gather else index, part, vocab,
        table.stride(0), words.shape[-1] if gather else 0, splits, GATHER=gather, MASKED=gather,
        BLOCK=PICK_BLOCK)
    _pick_done_kernel[(num,)](part, index, out, num, splits, at,
                              finite_at if gather else 0, FINITE=gather,
                              SB=triton.next_power_of_2(splits))


_SCRATCH: dict[torch.device, torch.Tensor] = {}


def _scratch(device: torch.device, numel: int) -> torch.Tensor:
    """The pick's partial results: one int32 buffer per device, grown when needed and reused by
    every step (stream order keeps a step's partials from being overwritten before they are read;
    no allocation on the host's path per step)."""
    buf = _SCRATCH.get(device)
    if buf is None or buf.numel() < numel:
        buf = _SCRATCH[device] = torch.empty(max(numel, 1 << 14), dtype=torch.int32,
                                             device=device)
    return buf[:numel]
