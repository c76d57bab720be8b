"""The vision tower's CUDA graphs (multimodal/graphs.py) replay the eager forward bit for bit, per
grid and mode, and the index memo they rely on (positions.device_index) hands out the same
indices the host builders make."""

from __future__ import annotations

import pytest
import torch

from deltaserve.multimodal import positions
from deltaserve.multimodal.merger import block_order
from deltaserve.multimodal.trace import random_pixels


def test_device_index_memo_returns_the_built_tensor_once(monkeypatch):
    calls = []
    cpu = torch.device("cpu")

    def build():
        calls.append(1)
        return block_order([(4, 6)], 2, 2)

    first = positions.device_index("test-order", [(4, 6)], cpu, build)
    again = positions.device_index("test-order", [(4, 6)], cpu, build)
    assert again is first and len(calls) == 1 and torch.equal(first, block_order([(4, 6)], 2, 2))
    other = positions.device_index("test-order", [(6, 4)], cpu, lambda: block_order([(6, 4)], 2, 2))
    assert not torch.equal(other, first)
    # least recently used out: with room for 2, touching (4, 6) keeps it and evicts (6, 4)
    monkeypatch.setattr(positions, "MAX_MEMO_ENTRIES", 2)
    positions.device_index("test-order", [(4, 6)], cpu, build)
    with positions.recording_indices() as used:
        positions.device_index("test-order", [(2, 2)], cpu, lambda: block_order([(2, 2)], 2, 2))
        assert positions.device_index("test-order", [(4, 6)], cpu, build) is first
    assert len(calls) == 1 and len(used) == 2 and used[1] is first  # what a capture holds
    rebuilt = positions.device_index("test-order", [(6, 4)], cpu, lambda: block_order([(6, 4)], 2, 2))
    assert rebuilt is not other and torch.equal(rebuilt, other)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tower_graph_replays_the_eager_forward(reduced_dir, dtype):
    from deltaserve.multimodal.loader import load_vision_model

    model = load_vision_model(reduced_dir, dtype, "cuda")
    grids_a, grids_b = [(16, 20)], [(8, 12), (12, 8)]
    pix_a = [random_pixels(grids_a, 14, seed=s).cuda() for s in range(4)]
    pix_b = random_pixels(grids_b, 14, seed=9).cuda()
    with torch.inference_mode():
        eager = [model._run(p, grids_a, "16x", None) for p in pix_a]
        eager_b = model._run(pix_b, grids_b, "4x", None)
        outs = [model(p, grids_a, "16x") for p in pix_a[:2]]  # first: eager, second: captured
        assert model._graphs.num_captures == 1
        got_b = [model(pix_b, grids_b, "4x") for _ in range(3)]  # another key between
        outs += [model(p, grids_a, "16x") for p in pix_a[2:]]  # replays
        assert model._graphs.num_captures == 2
    for got, want in zip(outs, eager, strict=True):
        assert torch.equal(got, want)
    assert all(torch.equal(g, eager_b) for g in got_b)
    assert outs[2].data_ptr() != outs[3].data_ptr()  # fresh tensors, not the static buffer
