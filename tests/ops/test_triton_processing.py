"""Triton logits processing against ops/processing.mask_rows_ref and penalize_ref (run on the
H200): bit-exact, on fresh random rows, masks with sign bits, a vocabulary that does not fill its
last word, rows taken out of order, edits on both signs of x, and the pick's ties and rows with
no token allowed."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops import triton_processing
from deltaserve.ops.processing import mask_pick_ref, mask_rows_ref, penalize_ref, pick_ref
from tests.ops.triton_device import KDEV, needs_kernels

pytestmark = pytest.mark.gpu


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [248320, 1000, 37])
def test_mask_rows_matches_reference(dtype, vocab) -> None:
    gen = torch.Generator(device=KDEV).manual_seed(vocab)
    logits = (torch.randn(6, vocab, device=KDEV, generator=gen) * 4).to(dtype)
    words = torch.randint(-2**31, 2**31 - 1, (3, (vocab + 31) // 32), dtype=torch.int32,
                          device=KDEV, generator=gen)
    index = torch.tensor([5, 0, 2, 2, 3], dtype=torch.int32, device=KDEV)
    mask_of = torch.tensor([1, -1, 0, 2, -1], dtype=torch.int32, device=KDEV)
    got = triton_processing.mask_rows_cuda(logits, index, mask_of, words)
    want = mask_rows_ref(logits, index, mask_of, words)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    none = triton_processing.mask_rows_cuda(logits, index[:2], mask_of[:2] * 0 - 1, words[:0])
    assert torch.equal(none, logits[[5, 0]].float())


@needs_kernels
@pytest.mark.parametrize("edits", [1, 300, 5000])
def test_penalize_matches_reference(edits) -> None:
    torch.manual_seed(edits)
    rows = torch.randn(4, 248320, device=KDEV) * 6
    at = torch.randperm(rows.numel(), device=KDEV)[:edits].to(torch.int32)
    r = torch.rand(edits, device=KDEV) * 1.5 + 0.5
    c = torch.randn(edits, device=KDEV)
    got, want = rows.clone(), rows.clone()
    triton_processing.penalize_cuda(got, at, r, c)
    penalize_ref(want, at, r, c)
    assert torch.equal(got, want)


@needs_kernels
@pytest.mark.parametrize("vocab", [248320, 4097, 37])
def test_pick_matches_reference(vocab) -> None:
    """Tokens land at the rows' places in the step's buffer, flags after it; ties keep the first
    index (also across blocks), a row masked everywhere is flagged 0."""
    gen = torch.Generator(device=KDEV).manual_seed(vocab)
    rows = torch.randn(5, vocab, device=KDEV, generator=gen)
    rows[rows < 0.5] = float("-inf")  # masked tokens
    rows[1] = float("-inf")  # nothing allowed
    top = rows[2].max() + 1
    rows[2, [vocab - 1, vocab // 2, 3]] = top  # a tie across blocks: the first wins
    rows[3, [7, 8]] = rows[3].max() + 1  # a tie inside one block
    index = torch.tensor([4, 0, 6, 1, 2], dtype=torch.int32, device=KDEV)
    fill = torch.full((7 + 3 + 5,), -5, dtype=torch.int64, device=KDEV)
    got, want = fill.clone(), fill.clone()
    triton_processing.pick_cuda(rows, index, got, 10)
    pick_ref(rows, index, want, 10)
    assert torch.equal(got, want)
    assert got[10:].tolist() == [1, 0, 1, 1, 1] and got[6] == 3 and got[1] == 7
    assert (got[[3, 5, 7, 8, 9]] == -5).all()  # rows not processed and other slots untouched


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [248320, 4097, 37])
def test_mask_pick_matches_reference(dtype, vocab) -> None:
    """The fused mask + pick: the same tokens and allowed flags as mask_rows then pick, each
    row's raw finite flag at finite_at + its row, rows with NaN or inf logits flagged 0, a row
    masked everywhere flagged not allowed, ties across blocks keeping the first index."""
    gen = torch.Generator(device=KDEV).manual_seed(vocab + 1)
    logits = (torch.randn(5, vocab, device=KDEV, generator=gen) * 4).to(dtype)
    words = torch.randint(-2**31, 2**31 - 1, (3, (vocab + 31) // 32), dtype=torch.int32,
                          device=KDEV, generator=gen)
    words[1] = 0  # row 1 below: nothing allowed
    words[2] = -1  # everything allowed: a tie across blocks on row 2
    top = logits[2].float().max() + 8
    logits[2, [vocab - 1, vocab // 2, 3]] = top.to(dtype)
    logits[4, vocab - 2] = float("nan")
    logits[3, 0] = float("inf")
    index = torch.tensor([4, 1, 2, 0, 3], dtype=torch.int32, device=KDEV)
    mask_of = torch.tensor([0, 1, 2, -1, 0], dtype=torch.int32, device=KDEV)
    fill = torch.full((5 + 5 + 5,), -5, dtype=torch.int64, device=KDEV)
    got, want = fill.clone(), fill.clone()
    triton_processing.mask_pick_cuda(logits, index, mask_of, words, got, 10, 5)
    mask_pick_ref(logits, index, mask_of, words, want, 10, 5)
    assert got[5:10].tolist() == want[5:10].tolist() == [1, 1, 1, 0, 0]  # rows 3, 4 not finite
    finite = [0, 1, 2]  # rows with finite logits: the reference's tokens and allowed flags
    assert got[finite].tolist() == want[finite].tolist()
    assert got[[11, 12, 13]].tolist() == want[[11, 12, 13]].tolist() == [0, 1, 1]
    assert got[2] == 3  # the first of the tie
