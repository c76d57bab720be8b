"""Token log-probabilities as the OpenAI API returns them: the prompt's by teacher forcing (`echo`
with prompt logprobs: what lm-evaluation-harness's loglikelihood requests read; runs on the
engine thread through bridge.call_every_rank: under `serve --tp` every rank runs the forward and
the vocabulary-parallel head), the generated tokens' from the engine's own step values."""

from __future__ import annotations

import torch


@torch.inference_mode()
def score(llm, ids: list[int], top_k: int) -> tuple[list[float | None], list[dict | None]]:
    """log p(ids[i] | ids[:i]) for each position (None for the first, which has no context) and
    the top_k alternatives there as {token text: logprob}, on a sequence of its own (the head over
    slices of positions: engine/prompt_logprobs.head_logprobs)."""
    from deltaserve.cache.sequence import Sequence
    from deltaserve.engine.prompt_logprobs import head_logprobs

    hidden = Sequence(llm.model, len(ids)).hidden(ids)
    entries = head_logprobs(llm.model, hidden[:-1], ids[1:], top_k)
    return _values(llm, [None, *entries], top_k)


def _values(llm, entries, top_k: int) -> tuple[list[float | None], list[dict | None]]:
    """Entries (logprob, ((id, logprob), ...)) or None -> (logprobs, {token text: logprob} or
    None per position)."""
    token_lps = [None if e is None else e[0] for e in entries]
    if top_k <= 0:
        return token_lps, [None] * len(entries)
    return token_lps, [None if e is None else {llm.tokenizer.decode([i]): v for i, v in e[1]}
                       for e in entries]


def _offsets(tokens: list[str], start: int) -> tuple[list[int], int]:
    """Each token's text offset counted from `start`, and the offset after the last one."""
    offsets = []
    for tok in tokens:
        offsets.append(start)
        start += len(tok)
    return offsets, start


def _chat_item(tok: str, lp: float, alts) -> dict:
    """One `content` entry of a chat completion's logprobs; alts: (text, logprob) pairs."""
    return {"token": tok, "logprob": lp, "bytes": list(tok.encode()),
            "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())}
                             for t, v in alts]}


def completion_logprobs(llm, ids: list[int], start: int, top_k: int) -> dict:
    """The `logprobs` object of a text completion for tokens ids[start:], teacher-forced (the
    prompt part of `echo`: the engine gives generated tokens their values as it samples)."""
    return _completion_object(llm, ids, start, top_k, *score(llm, ids, top_k))


def from_engine(llm, ids: list[int], entries: tuple, top_k: int) -> dict:
    """The same object from the engine's prompt logprobs (SamplingParams.prompt_logprobs: the
    prefill scored the prompt; engine/prompt_logprobs.py)."""
    return _completion_object(llm, ids, 0, top_k, *_values(llm, entries, top_k))


def echo_end(decode, ids: list[int]) -> int:
    """The text offset just after an echoed prompt's last token (its tokens' texts, joined)."""
    return _offsets([decode([t]) for t in ids], 0)[1]


def _completion_object(llm, ids, start, top_k, token_lps, tops) -> dict:
    tokens = [llm.tokenizer.decode([t]) for t in ids[start:]]
    return {"tokens": tokens, "token_logprobs": token_lps[start:],
            "top_logprobs": tops[start:] if top_k > 0 else None,
            "text_offset": _offsets(tokens, 0)[0]}


def step_logprobs(kind: str, decode, token_ids, entries, top_k: int, offset: int) -> tuple[dict,
                                                                                           int]:
    """The `logprobs` object of generated tokens from the engine's own per-token values
    (StepOutput.logprobs: (logprob, ((id, logprob), ...)) per token), and the text offset after
    them (completions count offsets from the start of the returned text)."""
    if kind == "chat.completion":
        content = [_chat_item(decode([tok_id]), lp, [(decode([i]), v) for i, v in alts])
                   for tok_id, (lp, alts) in zip(token_ids, entries, strict=True)]
        return {"content": content}, offset
    tokens = [decode([tok_id]) for tok_id in token_ids]
    offsets, offset = _offsets(tokens, offset)
    tops = [{decode([i]): v for i, v in alts} for _, alts in entries] if top_k > 0 else None
    return {"tokens": tokens, "token_logprobs": [lp for lp, _ in entries], "top_logprobs": tops,
            "text_offset": offsets}, offset


def joined(head: dict | None, tail: dict) -> dict:
    """A completion's logprobs: the echoed prompt's part (or none) followed by the generated."""
    if head is None:
        return tail
    tops = None if head["top_logprobs"] is None else head["top_logprobs"] + tail["top_logprobs"]
    return {key: head[key] + tail[key] for key in ("tokens", "token_logprobs", "text_offset")} | {
        "top_logprobs": tops}
