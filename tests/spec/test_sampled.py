"""Exact speculative sampling (spec/sampled.py): the emitted tokens are distributed as plain
sampling from the target, checked by drawing many times with a fixed seed."""

from __future__ import annotations

import torch

from deltaserve.engine.sampling import SamplingParams
from deltaserve.spec.sampled import accept_sampled

N = 20000


def _frequencies(logits, drafts, params, positions=1):
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros((logits.shape[-1],) * positions)
    for _ in range(N):
        num_ok, last = accept_sampled(logits, drafts, params, gen)
        emitted = (*drafts[:num_ok], last)[:positions]
        if len(emitted) == positions:
            counts[emitted] += 1
    return counts / N


def test_first_token_follows_the_target_whatever_the_draft() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.2, 0.1, 1e-9], [0.1, 0.1, 0.1, 0.1, 0.6]]))
    target = torch.softmax(logits[0], -1)
    for draft in (0, 3, 4):  # likely, unlikely, (almost) impossible
        freq = _frequencies(logits, (draft,), SamplingParams(temperature=1.0))
        sigma = (target * (1 - target) / N).sqrt()
        assert ((freq - target).abs() <= 4 * sigma + 1e-4).all(), (draft, freq, target)


def test_bonus_token_follows_the_next_row_after_an_accepted_draft() -> None:
    """P(first = d, second = x) = p0(d) p1(x): the joint of two emitted tokens."""
    p0 = torch.tensor([0.6, 0.3, 0.1])
    p1 = torch.tensor([0.2, 0.3, 0.5])
    logits = torch.log(torch.stack([p0, p1]))
    freq = _frequencies(logits, (0,), SamplingParams(temperature=1.0), positions=2)
    want = torch.zeros(3, 3)
    want[0] = p0[0] * p1  # only the accepted draft reaches a second token in this step
    sigma = (want * (1 - want) / N).sqrt()
    assert ((freq - want).abs() <= 4 * sigma + 1e-4).all(), (freq, want)


def test_filters_apply_before_acceptance() -> None:
    """top_k=2 leaves tokens 0 and 1: a draft outside them is always rejected, and the residual
    never yields a filtered token."""
    logits = torch.log(torch.tensor([[0.4, 0.35, 0.25]]))
    freq = _frequencies(logits.repeat(2, 1), (2,), SamplingParams(temperature=1.0, top_k=2))
    kept = torch.tensor([0.4, 0.35]) / 0.75
    assert freq[2] == 0
    assert ((freq[:2] - kept).abs() <= 4 * (kept * (1 - kept) / N).sqrt()).all()
