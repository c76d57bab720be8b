"""Logits processing on the device (engine/processors.py plans it on the host): the processed rows
as fp32 copies of the step's logits rows with their grammar masks applied, then the penalties as
edits of single logits, then each row's greedy token and flag picked in one pass. Shapes: R
logits rows, P processed rows, V vocabulary, K masked rows, W = ceil(V/32) mask words, E edits.

The mask goes first here although vLLM applies it last: a masked logit is -inf, and every later
step keeps -inf (a finite bias added, a positive repetition factor, a finite subtraction), so the
order changes no value."""

from __future__ import annotations

import torch

from deltaserve.ops.dispatch import REFERENCE, Case, Op, case

MASK_ROWS = Op("mask_rows", "processed rows: fp32 copies of logits rows, grammar bitmask applied")
PENALIZE = Op("penalize", "penalties as edits of single logits: where(x > 0, x / r, x * r) - c")
PICK = Op("pick", "processed rows' greedy tokens and 'a token was allowed' flags into one buffer")
MASK_PICK = Op("mask_pick", "mask_rows then pick in one pass, with each row's finite flag, when "
               "no penalty or per-row edit applies")

_BITS: dict[torch.device, torch.Tensor] = {}


def mask_rows_ref(logits: torch.Tensor, index: torch.Tensor, mask_of: torch.Tensor,
                  words: torch.Tensor) -> torch.Tensor:
    """logits [R,V]; index [P] int32, the logits row of processed row p; mask_of [P] int32, the
    row of words masking row p (-1: none); words [K,W] int32, bit t % 32 of word t // 32 set when
    token t is allowed (xgrammar's layout) -> [P,V] fp32, disallowed tokens -inf."""
    vocab = logits.shape[-1]
    out = logits.index_select(0, index.long()).float()
    if words.shape[0] == 0:
        return out
    if logits.device not in _BITS:
        _BITS[logits.device] = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> _BITS[logits.device]) & 1).bool().flatten(1)[:, :vocab]
    allowed = allowed.index_select(0, mask_of.clamp(min=0).long()) | (mask_of < 0)[:, None]
    return out.masked_fill_(~allowed, float("-inf"))


def penalize_ref(rows: torch.Tensor, at: torch.Tensor, r: torch.Tensor, c: torch.Tensor) -> None:
    """rows [P,V] fp32 (contiguous), changed in place at the flat indices at [E] (int32 or int64):
    x -> where(x > 0, x / r, x * r) - c, with r, c [E] fp32 (repetition factor, 1 where none;
    frequency * count + presence)."""
    flat = rows.view(-1)
    at = at.long()
    x = flat[at]
    flat[at] = torch.where(x > 0, x / r, x * r) - c


def pick_ref(rows: torch.Tensor, index: torch.Tensor, out: torch.Tensor, at: int) -> None:
    """rows [P,V] fp32 processed; index [P] int32 -> out (int64, on the device) changed in place:
    out[index[p]] = argmax(rows[p]) (the first of equal maxima, as torch.argmax), out[at + p] =
    1 if max(rows[p]) is finite else 0 (every token masked: no token was allowed)."""
    num = rows.shape[0]
    out.index_copy_(0, index.long(), rows.argmax(-1))
    out[at: at + num] = torch.isfinite(rows.amax(-1))


def mask_pick_ref(logits: torch.Tensor, index: torch.Tensor, mask_of: torch.Tensor,
                  words: torch.Tensor, out: torch.Tensor, at: int, finite_at: int) -> None:
    """pick_ref(mask_rows_ref(logits, index, mask_of, words), index, out, at), and out[finite_at
    + index[p]] = 1 if every raw logit of row index[p] is finite else 0 (the step's finite flags,
    when its rows are its chunks): the masked rows are never written out. A row whose logits are
    not all finite fails on that flag: its token and allowed flag are unspecified."""
    pick_ref(mask_rows_ref(logits, index, mask_of, words), index, out, at)
    finite = torch.isfinite(logits.index_select(0, index.long())).all(-1)
    out.index_copy_(0, index.long() + finite_at, finite.long())


def _triton_why_not(c: Case) -> str | None:
    if c.device != "cuda":
        return "not a CUDA tensor"
    from deltaserve.ops.backend import triton_enabled

    return None if triton_enabled() else "the triton backend is off"


def mask_rows(logits: torch.Tensor, index: torch.Tensor, mask_of: torch.Tensor,
              words: torch.Tensor) -> torch.Tensor:
    return MASK_ROWS(case(logits), logits, index, mask_of, words)


def penalize(rows: torch.Tensor, at: torch.Tensor, r: torch.Tensor, c: torch.Tensor) -> None:
    if at.numel():
        PENALIZE(case(rows), rows, at, r, c)


def pick(rows: torch.Tensor, index: torch.Tensor, out: torch.Tensor, at: int) -> None:
    if rows.shape[0]:
        PICK(case(rows), rows, index, out, at)


def mask_pick(logits: torch.Tensor, index: torch.Tensor, mask_of: torch.Tensor,
              words: torch.Tensor, out: torch.Tensor, at: int, finite_at: int) -> None:
    if index.shape[0]:
        MASK_PICK(case(logits), logits, index, mask_of, words, out, at, finite_at)


@MASK_ROWS.register("triton", 30, _triton_why_not)
def _mask_rows_triton(logits, index, mask_of, words):
    from deltaserve.ops import triton_processing

    return triton_processing.mask_rows_cuda(logits, index, mask_of, words)


@PENALIZE.register("triton", 30, _triton_why_not)
def _penalize_triton(rows, at, r, c):
    from deltaserve.ops import triton_processing

    triton_processing.penalize_cuda(rows, at, r, c)


@PICK.register("triton", 30, _triton_why_not)
def _pick_triton(rows, index, out, at):
    from deltaserve.ops import triton_processing

    triton_processing.pick_cuda(rows, index, out, at)


@MASK_PICK.register("triton", 30, _triton_why_not)
def _mask_pick_triton(logits, index, mask_of, words, out, at, finite_at):
    from deltaserve.ops import triton_processing

    triton_processing.mask_pick_cuda(logits, index, mask_of, words, out, at, finite_at)


MASK_ROWS.register(REFERENCE, 0)(mask_rows_ref)
PENALIZE.register(REFERENCE, 0)(penalize_ref)
PICK.register(REFERENCE, 0)(pick_ref)
MASK_PICK.register(REFERENCE, 0)(mask_pick_ref)
