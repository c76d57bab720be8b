"""Position ids equal transformers' own bucketization for every grid the table covers."""

from __future__ import annotations

import torch

from deltaserve.multimodal.positions import bucket_boundaries, piece_position_ids, position_ids


def test_every_grid_up_to_70_matches_transformers() -> None:
    from transformers.vision_utils import get_vision_nearest_position_ids

    side = 70
    boundaries = bucket_boundaries(side)
    for h in range(1, side + 1):
        for w in range(1, side + 1):
            ref = get_vision_nearest_position_ids(torch.tensor([[h, w]]), side)
            assert torch.equal(piece_position_ids(h, w, side, boundaries), ref), (h, w)


def test_packed_pieces_match_transformers() -> None:
    from transformers.vision_utils import get_vision_nearest_position_ids

    grids = [(32, 32), (28, 36), (70, 70), (4, 2), (98, 14)]  # 98 > 70: buckets repeat
    ref = get_vision_nearest_position_ids(torch.tensor(grids), 70)
    assert torch.equal(position_ids(grids, 70), ref)


def test_known_values() -> None:
    assert piece_position_ids(4, 2, 70)[:4].tolist() == [0, 35, 1190, 1225]  # formats.md 3.3
    assert torch.equal(piece_position_ids(70, 70, 70), torch.arange(4900))


def test_default_dtype_cannot_move_a_tie() -> None:
    before = piece_position_ids(28, 28, 70)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        after = piece_position_ids(28, 28, 70)
    finally:
        torch.set_default_dtype(old)
    assert torch.equal(before, after)
