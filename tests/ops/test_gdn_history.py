"""The compact history form of the GDN state against the dense decode step."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops.gdn import gdn_step
from deltaserve.ops.gdn_history import History, gdn_step_history


def test_history_steps_equal_the_dense_state() -> None:
    torch.manual_seed(0)
    bsz, heads, k_dim, v_dim, steps = 3, 4, 16, 8, 20
    dense = torch.zeros(bsz, heads, k_dim, v_dim)
    hist = History.empty(bsz, heads, k_dim, v_dim, capacity=steps)
    for _ in range(steps):
        q, k = torch.randn(bsz, heads, k_dim), torch.randn(bsz, heads, k_dim)
        v = torch.randn(bsz, heads, v_dim)
        g, beta = -torch.rand(bsz, heads), torch.rand(bsz, heads)
        want = gdn_step(q, k, v, g, beta, dense, qk_l2norm=True)
        got = gdn_step_history(q, k, v, g, beta, hist)
        assert ((got - want).norm() / want.norm()).item() < 1e-5
    assert ((hist.dense() - dense).norm() / dense.norm()).item() < 1e-5
    with pytest.raises(RuntimeError, match="full"):
        gdn_step_history(q, k, v, g, beta, hist)
