"""Exact speculative sampling for requests that sample (temperature > 0).

Both drafters propose deterministically (the n-gram match, the MTP head's argmax), so the draft
distribution at each position is a point mass q = delta(d). The standard acceptance rule (accept d
with probability min(1, p(d) / q(d)); on rejection draw from max(p - q, 0), renormalised) then
reads: accept d with probability p(d); on rejection draw from p with d removed. Every emitted token
is distributed exactly as plain sampling from the target p (the request's temperature, top-k,
top-p and min-p applied, engine/sampling.filtered_probs); when all drafts pass, the bonus token is
drawn from the last row. The random stream differs from plain decoding's, and how much of it a step
uses depends on timing (the pace gate) and the batch: requests with a seed therefore never draft
(spec/config.draftable) and stay reproducible.
"""

from __future__ import annotations

import torch

from deltaserve.engine.sampling import SamplingParams, filtered_probs


def accept_sampled(logits: torch.Tensor, drafts: tuple[int, ...], params: SamplingParams,
                   gen: torch.Generator | None) -> tuple[int, int]:
    """logits [k+1, vocab]: row j is the target's next-token logits after draft j (row 0: after
    the pending token). Returns (drafts accepted, the token drawn after them)."""
    num_drafts = len(drafts)
    probs = filtered_probs(logits, [params] * (num_drafts + 1))
    probs = probs / probs.sum(-1, keepdim=True)
    num_ok = num_drafts
    if num_drafts:
        rows = torch.arange(num_drafts, device=probs.device)
        p_draft = probs[rows, torch.tensor(drafts, device=probs.device)]
        u = torch.rand(num_drafts, generator=gen, device=probs.device)
        passed = (u < p_draft).tolist()
        num_ok = passed.index(False) if False in passed else num_drafts
    if num_ok < num_drafts:
        residual = probs[num_ok].clone()
        residual[drafts[num_ok]] = 0.0
        total = residual.sum()
        dist = residual / total if total > 0 else probs[num_ok]
    else:
        dist = probs[num_drafts]
    return num_ok, int(torch.multinomial(dist, 1, generator=gen).item())
