"""Token log-probabilities by teacher forcing: the model's own next-token distributions over a
token sequence, as the OpenAI API returns them (`logprobs`, `echo` with prompt logprobs: what
lm-evaluation-harness's loglikelihood requests read). Runs on the engine thread (bridge.call)."""

from __future__ import annotations

import torch

ROWS_PER_HEAD_CALL = 256  # positions per head GEMM: [256, 248320] fp32 logits is 254 MB


@torch.inference_mode()
def score(llm, ids: list[int], top_k: int) -> tuple[list[float | None], list[dict | None]]:
    """log p(ids[i] | ids[:i]) for each position (None for the first, which has no context) and
    the top_k alternatives there as {token text: logprob}. The head runs over the positions in
    slices, so a long prompt never materialises [T, vocab] logits at once."""
    from deltaserve.layers.linear import linear
    from deltaserve.quant.linear import is_quantized, quant_linear

    model = llm.model
    hidden = model.hidden_states(torch.tensor([ids], device=model.device), model.new_state())[0]
    head = model.head
    token_lps: list[float | None] = [None]
    tops: list[dict | None] = [None]
    for lo in range(0, len(ids) - 1, ROWS_PER_HEAD_CALL):
        hi = min(lo + ROWS_PER_HEAD_CALL, len(ids) - 1)  # row i predicts token i+1
        h = hidden[lo:hi]
        logits = (quant_linear(h, head) if is_quantized(head) else linear(h, head.weight))
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


def completion_logprobs(llm, ids: list[int], start: int, top_k: int) -> dict:
    """The `logprobs` object of a text completion for tokens ids[start:]."""
    token_lps, tops = score(llm, ids, top_k)
    tokens = [llm.tokenizer.decode([t]) for t in ids[start:]]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": token_lps[start:],
            "top_logprobs": tops[start:] if top_k > 0 else None, "text_offset": offsets}


def chat_logprobs(llm, ids: list[int], start: int, top_k: int) -> dict:
    """The `logprobs` object of a chat completion for the generated tokens ids[start:]."""
    token_lps, tops = score(llm, ids, top_k)
    content = []
    for i in range(start, len(ids)):
        tok = llm.tokenizer.decode([ids[i]])
        alts = [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                for t, lp in (tops[i] or {}).items()]
        content.append({"token": tok, "logprob": token_lps[i], "bytes": list(tok.encode()),
                        "top_logprobs": alts})
    return {"content": content}


def step_logprobs(kind: str, decode, token_ids, entries, top_k: int, offset: int) -> tuple[dict,
                                                                                           int]:
    """The `logprobs` object of one streamed chunk from the engine's own per-token values
    (StepOutput.logprobs: (logprob, ((id, logprob), ...)) per token), and the text offset after
    it (completions count offsets from the start of the returned text)."""
    if kind == "chat.completion":
        content = []
        for tok_id, (lp, alts) in zip(token_ids, entries, strict=True):
            tok = decode([tok_id])
            top = [{"token": (t := decode([i])), "logprob": v, "bytes": list(t.encode())}
                   for i, v in alts]
            content.append({"token": tok, "logprob": lp, "bytes": list(tok.encode()),
                            "top_logprobs": top})
        return {"content": content}, offset
    tokens, offsets = [], []
    for tok_id in token_ids:
        tokens.append(decode([tok_id]))
        offsets.append(offset)
        offset += len(tokens[-1])
    tops = [{decode([i]): v for i, v in alts} for _, alts in entries] if top_k > 0 else None
    return {"tokens": tokens, "token_logprobs": [lp for lp, _ in entries], "top_logprobs": tops,
            "text_offset": offsets}, offset
