"""Chunked delta-rule scan and decode step against the sequential recurrence (fp32, fresh inputs)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops.gdn import gdn_chunked, gdn_recurrent_ref, gdn_step, l2norm


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def random_inputs(bsz: int, seq_len: int, heads: int, k_dim: int, v_dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(bsz, seq_len, heads, k_dim, generator=gen)
    k = torch.randn(bsz, seq_len, heads, k_dim, generator=gen)
    v = torch.randn(bsz, seq_len, heads, v_dim, generator=gen)
    # decays spread from nearly 1 to strong, as trained models have
    g = -torch.rand(bsz, seq_len, heads, generator=gen) * torch.linspace(0.01, 4.0, heads)
    beta = torch.rand(bsz, seq_len, heads, generator=gen)
    state = torch.randn(bsz, heads, k_dim, v_dim, generator=gen) * 0.1
    return q, k, v, g, beta, state


@pytest.mark.parametrize("seq_len", [1, 2, 37, 64, 65, 128, 200])
@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "carried-state"])
def test_chunked_equals_recurrence(seq_len: int, with_state: bool) -> None:
    q, k, v, g, beta, state = random_inputs(2, seq_len, 4, 32, 48, seed=seq_len)
    init = state if with_state else None
    out_ref, s_ref = gdn_recurrent_ref(q, k, v, g, beta, init, qk_l2norm=True)
    out, s = gdn_chunked(q, k, v, g, beta, init, qk_l2norm=True)
    assert rel(out, out_ref) <= 1e-5
    assert rel(s, s_ref) <= 1e-5


@pytest.mark.parametrize("chunk_len", [16, 32, 64])
def test_chunk_len_does_not_change_result(chunk_len: int) -> None:
    q, k, v, g, beta, state = random_inputs(1, 150, 2, 16, 16, seed=7)
    out_ref, _ = gdn_recurrent_ref(q, k, v, g, beta, state, qk_l2norm=True)
    out, _ = gdn_chunked(q, k, v, g, beta, state, chunk_len=chunk_len, qk_l2norm=True)
    assert rel(out, out_ref) <= 1e-5


def test_step_equals_recurrence_and_updates_state_in_place() -> None:
    q, k, v, g, beta, state = random_inputs(2, 20, 3, 16, 24, seed=3)
    out_ref, s_ref = gdn_recurrent_ref(q, k, v, g, beta, state, qk_l2norm=True)
    s = state.clone()
    outs = [
        gdn_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], s, qk_l2norm=True)
        for t in range(20)
    ]
    assert rel(torch.stack(outs, 1), out_ref) <= 1e-5
    assert rel(s, s_ref) <= 1e-5
    assert rel(s, state) > 1e-2  # the step really wrote into the state it was given


def test_recurrence_against_float64() -> None:
    """The reference itself: fp32 recurrence within 1e-5 of a float64 run of the same formula."""
    q, k, v, g, beta, state = random_inputs(1, 100, 2, 16, 16, seed=11)
    out32, _ = gdn_recurrent_ref(q, k, v, g, beta, state, qk_l2norm=True)
    s = state.double().clone()
    qd, kd = q.double(), k.double()
    qn = qd / torch.sqrt((qd * qd).sum(-1, keepdim=True) + 1e-6) * 16**-0.5
    kn = kd / torch.sqrt((kd * kd).sum(-1, keepdim=True) + 1e-6)
    for t in range(100):
        s = s * g[:, t].double().exp()[..., None, None]
        delta = (v[:, t].double() - torch.einsum("bhkv,bhk->bhv", s, kn[:, t])) * beta[
            :, t
        ].double()[..., None]
        s = s + kn[:, t][..., None] * delta[..., None, :]
        assert rel(out32[:, t].double(), torch.einsum("bhkv,bhk->bhv", s, qn[:, t])) <= 1e-5


def test_l2norm_puts_eps_on_the_sum() -> None:
    x = torch.full((1, 4), 1e-4)
    expected = x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)
    assert torch.allclose(l2norm(x), expected, rtol=1e-6, atol=0)
    # eps on the mean would give a visibly different value for such a small vector
    on_mean = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)
    assert not torch.allclose(l2norm(x), on_mean, rtol=1e-3)
