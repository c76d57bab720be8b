"""Prompt log-probabilities inside the engine (vLLM's SamplingParams.prompt_logprobs): the rows of
a request's prefill chunks go through the head in the step that computes them, so a prompt is
scored by the same forward that prefills it (`echo` with logprobs: one forward per request).

Such a request computes every prompt position (no prefix-cache resume: the positions a snapshot
skips would have no values) and its steps run on the eager executor with the final hidden rows
kept; its snapshots still enter the prefix cache for later requests. Per position i >= 1 the value
is log p(prompt[i] | prompt[:i]) under the raw model distribution and the k most likely tokens
there, as StepOutput.logprobs gives a generated token's."""

from __future__ import annotations

import torch

ROWS_PER_HEAD_CALL = 256  # positions per head GEMM: [256, 248320] fp32 logits is 254 MB
Entry = tuple[float, tuple[tuple[int, float], ...]]  # (logprob, ((top id, logprob), ...))


def unavailable(engine) -> str | None:
    """Why this engine cannot give prompt logprobs (None: it can). Under tensor or pipeline
    parallelism the head is a collective the other ranks do not enter for one request's rows."""
    if engine.config.greedy_head:
        return "this engine runs the greedy-only head (no logits are computed)"
    model = engine.model
    if getattr(model, "tp", None) is not None or getattr(model, "pp", None) is not None:
        return "prompt logprobs are not computed in the engine under tensor or pipeline " \
               "parallelism"
    return None


def wanted(engine, plan) -> set[str]:
    """The requests of this plan whose chunk covers prompt positions that predict a prompt token
    (positions 0 .. len(prompt) - 2) and that asked for prompt logprobs."""
    out = set()
    for c in plan.chunks:
        live = engine.live(c.request_id)
        if live is None or live.params.prompt_logprobs is None:
            continue
        if c.start_pos < len(engine.scheduler.get(c.request_id).prompt_ids) - 1:
            out.add(c.request_id)
    return out


@torch.inference_mode()
def record(engine, plan, hidden: torch.Tensor, want: set[str]) -> None:
    """Each wanted chunk's rows [rows, N] of the step's final hidden [T, N] through the head:
    the values of the prompt tokens they predict, kept on the request's live record by position
    (a recomputed prefill after a preemption writes the same positions again)."""
    row = 0
    for c in plan.chunks:
        rows = len(c.token_ids)
        if c.request_id in want:
            live = engine.live(c.request_id)
            prompt = engine.scheduler.get(c.request_id).prompt_ids
            last = min(c.start_pos + rows, len(prompt) - 1)  # rows predicting prompt tokens
            n = last - c.start_pos
            entries = head_logprobs(engine.model, hidden[row: row + n],
                                    prompt[c.start_pos + 1: last + 1], live.params.prompt_logprobs)
            for i, entry in enumerate(entries):
                live.prompt_lps[c.start_pos + 1 + i] = entry
        row += rows


def head_logprobs(model, hidden: torch.Tensor, next_ids: list[int], top_k: int) -> list[Entry]:
    """hidden [R, N] (row r predicts next_ids[r]) -> R entries, the head run over slices of
    ROWS_PER_HEAD_CALL rows so a long prompt never holds [R, vocab] logits at once."""
    out: list[Entry] = []
    for lo in range(0, len(next_ids), ROWS_PER_HEAD_CALL):
        hi = min(lo + ROWS_PER_HEAD_CALL, len(next_ids))
        logp = torch.log_softmax(model.head_out(hidden[lo:hi]).float(), dim=-1)
        nxt = torch.tensor(next_ids[lo:hi], device=logp.device)
        values = logp.gather(1, nxt[:, None])[:, 0].tolist()
        if top_k > 0:
            top_v, top_i = logp.topk(top_k, dim=-1)
            alts = [tuple(zip(i, v, strict=True))
                    for i, v in zip(top_i.tolist(), top_v.tolist(), strict=True)]
        else:
            alts = [()] * (hi - lo)
        out.extend(zip(values, alts, strict=True))
    return out


def take(live, num_prompt: int) -> tuple[Entry | None, ...] | None:
    """The request's prompt logprobs, once (its first output carries them): None for position 0,
    which has no context."""
    if live.params.prompt_logprobs is None or live.prompt_sent:
        return None
    live.prompt_sent = True
    return (None, *(live.prompt_lps[i] for i in range(1, num_prompt)))
