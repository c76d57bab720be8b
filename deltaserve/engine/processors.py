"""Logits processing: what changes a request's next-token logits before the sampler draws, applied
to the step's processed rows together (rows [P, V] fp32, a copy: free rows are never touched).

Order (vLLM's): allowed_token_ids, bad_words, min_tokens, logit_bias, then the penalties
(repetition over prompt and output tokens, then frequency and presence over output tokens), then
the grammar mask. The formulas:
  repetition r:  x / r where x > 0, x * r otherwise, for tokens seen in the prompt or output
  frequency f:   x - f * count(output)        presence p:  x - p * (count(output) > 0)
With thinking, the grammar starts after the reasoning block closes (its closing token is the last
one the grammar does not see).
"""

from __future__ import annotations

import torch

from deltaserve.engine.sampling import SamplingParams
from deltaserve.errors import RequestError


class Processor:
    """One request's processing state: counts of its output tokens, its masks, its matcher."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], eos_ids: frozenset[int],
                 vocab_size: int, device: torch.device, tokenizer, grammars=None,
                 think_ids: tuple[int | None, int | None] = (None, None)) -> None:
        self.params = params
        p = params
        for t in (*(t for t, _ in p.logit_bias or ()), *(p.allowed_token_ids or ())):
            if not 0 <= t < vocab_size:
                raise RequestError(f"token id {t} is outside the vocabulary (0..{vocab_size - 1})")
        self.num_out = 0
        self.tail: list[int] = []  # the last output tokens (multi-token bad words)
        # penalties touch only tokens seen so far: kept sparse (a dense [V] pass per penalty
        # costs ~0.2 ms per row on a CPU for a 248k vocabulary)
        self.counts: dict[int, int] | None = None  # output token -> count
        self.repeated: set[int] | None = None  # prompt and output tokens (repetition penalty)
        if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0:
            self.counts = {}
        self._repeated_ids = None  # the set as a tensor, rebuilt only when the set grows
        if p.repetition_penalty != 1.0:
            self.repeated = set(prompt_ids)
        self.bias = None
        if p.logit_bias:
            ids, values = zip(*p.logit_bias, strict=True)
            self.bias = (torch.tensor(ids, device=device),
                         torch.tensor(values, dtype=torch.float32, device=device))
        self.banned = None  # [V] bool: allowed_token_ids' complement
        if p.allowed_token_ids is not None:
            self.banned = torch.ones(vocab_size, dtype=torch.bool, device=device)
            self.banned[torch.tensor(p.allowed_token_ids, device=device)] = False
        self.bad_words = _bad_word_ids(tokenizer, p.bad_words or ())
        self.stop_list = sorted(set(eos_ids) | set(p.stop_token_ids))
        self.stop_ids = torch.tensor(self.stop_list,
                                     dtype=torch.long, device=device)
        self.matcher = None
        self.waiting_for = None  # the token that closes the reasoning block, until it comes
        if p.structured_outputs is not None:
            self.matcher = grammars.matcher(p.structured_outputs)
            opened, closed = think_ids
            if opened is not None and closed is not None and opened in prompt_ids and \
                    _last(prompt_ids, opened) > _last(prompt_ids, closed):
                self.waiting_for = closed

    def repeated_ids(self) -> torch.Tensor:
        """The repetition penalty's tokens (prompt and output) as a long tensor on the host: a
        long prompt's set is turned into a tensor once, not every step."""
        if self._repeated_ids is None:
            self._repeated_ids = torch.tensor(sorted(self.repeated), dtype=torch.long)
        return self._repeated_ids

    @property
    def constrained(self) -> bool:
        """The grammar applies to the next token."""
        return self.matcher is not None and self.waiting_for is None

    def accept(self, token: int) -> bool:
        """Record a sampled token; False if the grammar refuses it."""
        self.num_out += 1
        if self.counts is not None:
            self.counts[token] = self.counts.get(token, 0) + 1
        if self.repeated is not None and token not in self.repeated:
            self.repeated.add(token)
            self._repeated_ids = None
        if self.bad_words:
            self.tail = (self.tail + [token])[-max(len(w) for w in self.bad_words):]
        if self.matcher is None:
            return True
        if self.waiting_for is not None:
            if token == self.waiting_for:
                self.waiting_for = None
            return True
        return self.matcher.is_terminated() or self.matcher.accept_token(token)


def grammar_masks(procs: list[Processor], grammars, device: torch.device):
    """(indices of the constrained rows, their bitmask [K, ceil(V/32)] int32 on the host) or
    None. Host work only: the engine calls it before anything waits for the step's logits, so
    on a GPU the masks are filled while the forward runs."""
    constrained = [i for i, proc in enumerate(procs) if proc.constrained]
    if not constrained:
        return None
    mask = grammars.bitmask(len(constrained), pin=device.type == "cuda")
    for k, i in enumerate(constrained):
        if not procs[i].matcher.is_terminated():
            procs[i].matcher.fill_next_token_bitmask(mask, k)
        else:  # the grammar is complete: only a stop token may follow
            mask[k] = 0
            _allow(mask[k], procs[i].stop_list)
    return constrained, mask


def apply(rows: torch.Tensor, procs: list[Processor], grammars=None, masks=None) -> torch.Tensor:
    """rows [P, V] fp32 (row i is procs[i]'s logits; changed in place) -> rows. masks: from
    grammar_masks (filled here when not given)."""
    if masks is None and grammars is not None:
        masks = grammar_masks(procs, grammars, rows.device)
    neg = float("-inf")
    for i, proc in enumerate(procs):
        row = rows[i]
        if proc.banned is not None:
            row.masked_fill_(proc.banned, neg)
        for word in proc.bad_words:
            if len(word) == 1 or proc.tail[len(proc.tail) - len(word) + 1:] == list(word[:-1]):
                row[word[-1]] = neg
        if proc.num_out < proc.params.min_tokens:
            row.index_fill_(0, proc.stop_ids, neg)
        if proc.bias is not None:
            row.index_add_(0, proc.bias[0], proc.bias[1])
    _penalize(rows, procs)
    if masks is not None:  # last, as vLLM: a masked logit stays -inf under every step above
        apply_bitmask(rows, masks[1], masks[0])
    return rows


_BITS: dict[torch.device, torch.Tensor] = {}


def apply_bitmask(rows: torch.Tensor, mask: torch.Tensor, indices: list[int]) -> None:
    """rows[indices[k]] = -inf where bit t of mask[k] is 0 (bit t % 32 of word t // 32): what
    xgrammar's apply_token_bitmask_inplace does, as plain tensor ops on any device (its CPU
    kernel took 0.95 ms a row on the 248k vocabulary, these 0.12 ms; nothing to compile on a
    GPU). mask: [K, ceil(V/32)] int32 on the host."""
    vocab = rows.shape[-1]
    if rows.device not in _BITS:
        _BITS[rows.device] = torch.arange(32, dtype=torch.int32, device=rows.device)
    words = mask.to(rows.device, non_blocking=True)
    allowed = ((words.unsqueeze(-1) >> _BITS[rows.device]) & 1).bool().flatten(1)[:, :vocab]
    if indices == list(range(rows.shape[0])):
        rows.masked_fill_(~allowed, float("-inf"))
        return
    index = torch.tensor(indices, device=rows.device)
    rows.index_copy_(0, index, rows.index_select(0, index).masked_fill_(~allowed, float("-inf")))


def _penalize(rows: torch.Tensor, procs: list[Processor]) -> None:
    """The three penalties on the tokens each row has seen, as a few gathers and scatters over
    the flattened rows (the formulas leave the other tokens' logits as they are)."""
    vocab = rows.shape[-1]
    rep_at, rep_by, out_at, out_count, freq, pres = [], [], [], [], [], []
    for i, proc in enumerate(procs):
        p = proc.params
        if proc.repeated:
            ids = proc.repeated_ids()
            rep_at.append(ids + i * vocab)
            rep_by.append(torch.full(ids.shape, p.repetition_penalty))
        if proc.counts and (p.frequency_penalty or p.presence_penalty):
            out_at += [i * vocab + t for t in proc.counts]
            out_count += list(proc.counts.values())
            freq += [p.frequency_penalty] * len(proc.counts)
            pres += [p.presence_penalty] * len(proc.counts)
    flat = rows.view(-1)

    def tensor(xs: list, dtype=torch.float32) -> torch.Tensor:
        return torch.tensor(xs, dtype=dtype).to(rows.device, non_blocking=True)

    if rep_at:
        at = torch.cat(rep_at).to(rows.device, non_blocking=True)
        by = torch.cat(rep_by).to(rows.device, non_blocking=True)
        x = flat[at]
        flat[at] = torch.where(x > 0, x / by, x * by)
    if out_at:
        at = tensor(out_at, torch.long)
        x = flat[at] - tensor(freq) * tensor(out_count)
        flat[at] = x - tensor(pres)


def _allow(mask_row: torch.Tensor, tokens: list[int]) -> None:
    """Set the tokens' bits in an int32 bitmask row (bit t % 32 of word t // 32)."""
    for t in tokens:
        word = (int(mask_row[t // 32]) & 0xFFFFFFFF) | (1 << (t % 32))
        mask_row[t // 32] = word - (1 << 32) if word >= 1 << 31 else word


def _last(ids: list[int], token: int) -> int:
    """The index of token's last occurrence in ids, -1 if absent."""
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] == token:
            return i
    return -1


def _bad_word_ids(tokenizer, words: tuple[str, ...]) -> list[tuple[int, ...]]:
    """Each bad word's token sequences, as vLLM forms them: the word as given (leading spaces
    dropped) and with one leading space (how it reads mid-sentence)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        for prefix in ("", " "):
            ids = tuple(tokenizer.encode(prefix + word.lstrip()))
            if ids and ids not in out:
                out.append(ids)
    return out
