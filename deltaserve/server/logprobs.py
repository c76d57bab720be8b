"""Token log-probabilities as the OpenAI API returns them: the prompt's by teacher forcing (`echo`
with prompt logprobs: what lm-evaluation-harness's loglikelihood requests read; runs on the
engine thread through bridge.call_every_rank: under `serve --tp` every rank runs the forward and
the vocabulary-parallel head), the generated tokens' from the engine's own step values."""

from __future__ import annotations

import torch

ROWS_PER_HEAD_CALL = 256  # positions per head GEMM: [256, 248320] fp32 logits is 254 MB


@torch.inference_mode()
def score(llm, ids: list[int], top_k: int) -> tuple[list[float | None], list[dict | None]]:
    """log p(ids[i] | ids[:i]) for each position (None for the first, which has no context) and
    the top_k alternatives there as {token text: logprob}. The head runs over the positions in
    slices, so a long prompt never materialises [T, vocab] logits at once."""
    from deltaserve.cache.sequence import Sequence
    from deltaserve.layers.linear import linear
    from deltaserve.quant.linear import is_quantized, quant_linear

    model = llm.model
    hidden = Sequence(model, len(ids)).hidden(ids)
    head = model.head
    token_lps: list[float | None] = [None]
    tops: list[dict | None] = [None]
    for lo in range(0, len(ids) - 1, ROWS_PER_HEAD_CALL):
        hi = min(lo + ROWS_PER_HEAD_CALL, len(ids) - 1)  # row i predicts token i+1
        h = hidden[lo:hi]
        if model.tp is not None:  # vocabulary-parallel head: every rank's rows, gathered
            logits = model.tp.logits(h, head)
        else:
            logits = quant_linear(h, head) if is_quantized(head) else linear(h, head.weight)
        logp = torch.log_softmax(logits.float(), dim=-1)
        nxt = torch.tensor(ids[lo + 1 : hi + 1], device=logp.device)
        token_lps.extend(logp.gather(1, nxt[:, None])[:, 0].tolist())
        if top_k > 0:
            values, indices = logp.topk(top_k, dim=-1)
            for vals, idxs in zip(values.tolist(), indices.tolist(), strict=True):
                tops.append({llm.tokenizer.decode([i]): v
                             for i, v in zip(idxs, vals, strict=True)})
        else:
            tops.extend([None] * (hi - lo))
    return token_lps, tops


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
    token_lps, tops = score(llm, ids, top_k)
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
