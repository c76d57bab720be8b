"""Greedy decoding without materialising the logits: the head runs over the vocabulary in tiles
and keeps each row's running maximum and its index (first index on ties, as torch.argmax).

A [rows, vocab] fp32 logits tensor is 1 MB per row for Qwen3.5's 248,320 tokens (128 MB at batch
128); tiles of TILE_ROWS head rows keep it to [rows, TILE_ROWS]. Each tile is computed by the same
kernels, on the same rows, as the whole head (tile edges are multiples of 64, so no row moves
between a kernel's blocked and tail paths): the tokens equal argmax of the full logits exactly.
"""

from __future__ import annotations

import torch

from deltaserve.ops.dispatch import REFERENCE, Case, Op, case

TILE_ROWS = 32768


def _rows_of(module, start: int, end: int):
    """The head restricted to vocabulary rows [start, end): a plain tensor or a packed view."""
    from deltaserve.quant.linear import row_view

    if getattr(module, "scheme", None) is None:
        return module.weight[start:end]
    return row_view(module, start, end)


GREEDY_HEAD = Op("greedy_head", "argmax tokens of the head's logits, never materialised",
                 ("scheme", "rows within the kernel", "rows<=8"))


def greedy_tokens(h: torch.Tensor, head, tile_rows: int = TILE_ROWS) -> torch.Tensor:
    """h [R, N] final hidden states; head: the module whose weight [vocab, N] maps them to logits
    (maybe quantized). Returns argmax tokens [R] int64. On CUDA (Triton) the head and the argmax
    are one kernel (ops/triton_head); elsewhere greedy_tokens_ref."""
    from deltaserve.ops import triton_head

    rows = h.shape[0]
    c = case(h, (getattr(head, "scheme", None), rows <= triton_head.MAX_ROWS, rows <= 8))
    return GREEDY_HEAD(c, h, head, tile_rows)


def _triton_why_not(c: Case, packed: bool) -> str | None:
    from deltaserve.ops import triton_head
    from deltaserve.ops.triton_qgemv import supports

    scheme, within, few = c.shape
    if c.device != "cuda":
        return "not a CUDA tensor"
    if (scheme is not None) != packed:
        return "a packed head" if scheme is not None else "a dense head"
    if not within or (packed and not (few and supports(scheme))):
        return "too many rows, or a layout the kernel does not read"
    return None if triton_head.available() else "the triton backend is off"


@GREEDY_HEAD.register("triton_dense", 30, lambda c: _triton_why_not(c, False))
def _greedy_dense(h, head, tile_rows):
    from deltaserve.ops import triton_head

    return triton_head.greedy_dense_cuda(h, head.weight)


@GREEDY_HEAD.register("triton_packed", 30, lambda c: _triton_why_not(c, True))
def _greedy_packed(h, head, tile_rows):
    from deltaserve.ops import triton_head

    return triton_head.greedy_packed_cuda(h, head)


def greedy_tokens_ref(h: torch.Tensor, head, tile_rows: int = TILE_ROWS) -> torch.Tensor:
    """The head in tiles of `tile_rows` vocabulary rows by the same kernels as the full head,
    a running maximum per row: equal to argmax of the materialised logits."""
    from deltaserve.layers.linear import linear
    from deltaserve.quant.linear import quant_linear

    vocab = head.weight.shape[0]
    best_val = torch.full((h.shape[0],), float("-inf"), device=h.device)
    best_idx = torch.zeros(h.shape[0], dtype=torch.long, device=h.device)
    for start in range(0, vocab, tile_rows):
        part = _rows_of(head, start, min(start + tile_rows, vocab))
        logits = (quant_linear(h, part) if not isinstance(part, torch.Tensor)
                  else linear(h, part)).float()
        val, idx = logits.max(dim=-1)
        better = val > best_val  # strictly: an earlier tile keeps a tie
        best_val = torch.where(better, val, best_val)
        best_idx = torch.where(better, idx + start, best_idx)
    return best_idx


GREEDY_HEAD.register(REFERENCE, 0)(greedy_tokens_ref)
