"""Logits processing: what changes a request's next-token logits before the sampler draws, applied
to the step's processed rows together (rows [P, V] fp32, a copy: free rows are never touched).

Order (vLLM's): allowed_token_ids, bad_words, min_tokens, logit_bias, then the penalties
(repetition over prompt and output tokens, then frequency and presence over output tokens), then
the grammar mask (applied first, which changes no value: ops/processing.py). The formulas:
  repetition r:  x / r where x > 0, x * r otherwise, for tokens seen in the prompt or output
  frequency f:   x - f * count(output)        presence p:  x - p * (count(output) > 0)
With thinking, the grammar starts after the reasoning block closes (its closing token is the last
one the grammar does not see).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deltaserve.engine.sampling import SamplingParams
from deltaserve.errors import RequestError
from deltaserve.ops.processing import mask_rows, penalize

# a processed request's row with every token masked (its stop_reason; the server's 400)
NO_TOKEN = ("no token is allowed (allowed_token_ids, bad_words, min_tokens, logit_bias and the "
            "grammar together left none)")


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

    def repeated_ids(self) -> np.ndarray:
        """The repetition penalty's tokens (prompt and output), sorted, int64: a long prompt's
        set is turned into an array once, not every step."""
        if self._repeated_ids is None:
            self._repeated_ids = np.array(sorted(self.repeated), np.int64)
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


class Staging:
    """Where a step's processing is planned on the host: one int32 buffer (pinned on CUDA) holding
    the row indices, the grammar masks and the penalties' edits, copied to the device in one
    transfer. Two buffers alternate: the copy of step k is done before step k+2 refills its
    buffer (the engine has read step k's tokens back by then). Each host buffer has its device
    twin, reused in stream order, and the views of a layout (rows, masked rows, edits) are made
    once: a step of the same shape as an earlier one allocates nothing and builds no views."""

    def __init__(self, pin: bool) -> None:
        self.pin, self.bufs, self.turn = pin, [None, None], 0
        self.devs: list = [None, None]
        self._layouts: dict[tuple, Layout] = {}

    def take(self, numel: int) -> torch.Tensor:
        self.turn ^= 1
        buf = self.bufs[self.turn]
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 1 << 16), dtype=torch.int32, pin_memory=self.pin)
            self.bufs[self.turn] = buf
            self.devs[self.turn] = None
            self._layouts = {k: v for k, v in self._layouts.items() if k[0] != self.turn}
        return buf[:numel]

    def layout(self, num: int, masked: int, words_n: int, edits: int,
               device: torch.device) -> Layout:
        """The next buffer's views for this shape (see stage for the layout)."""
        size = 2 * num + masked * words_n + 3 * edits
        buf = self.take(size)
        key = (self.turn, num, masked, words_n, edits, device)
        lay = self._layouts.get(key)
        if lay is None:
            if len(self._layouts) > 64:  # shapes come and go with the batch: keep a few
                self._layouts.clear()
            dev = buf
            if device.type != "cpu":
                twin = self.devs[self.turn]
                if twin is None or twin.device != device:
                    twin = self.devs[self.turn] = torch.empty(
                        self.bufs[self.turn].numel(), dtype=torch.int32, device=device)
                dev = twin[:size]
            lay = self._layouts[key] = Layout(buf, dev, num, masked, words_n, edits)
        return lay


class Layout:
    """One staging buffer's views for one step shape: host [2P + K*W + 3E] int32 (rows, masked
    row of each row, K mask rows of W words, E edit indices, then r and c as fp32 bits) and the
    same views of its device twin (the buffer itself on a CPU)."""

    def __init__(self, buf: torch.Tensor, dev: torch.Tensor, num: int, masked: int, words_n: int,
                 edits: int) -> None:
        self.buf, self.dev, self.host = buf, dev, buf.numpy()
        self.floats = self.host.view(np.float32)
        base = 2 * num + masked * words_n
        self.words = buf[2 * num: base].view(masked, words_n)
        self.views = (dev[:num], dev[num:2 * num], dev[2 * num: base].view(masked, words_n),
                      dev[base: base + edits], dev[base + edits: base + 2 * edits].view(
                          torch.float32), dev[base + 2 * edits:].view(torch.float32))

    def send(self) -> None:
        """The host buffer to its device twin (queued: the pinned copy does not wait)."""
        if self.dev is not self.buf:
            self.dev.copy_(self.buf, non_blocking=True)


@dataclass(frozen=True, slots=True)
class Staged:
    """A step's processing as planned on the host, on the table's device: index [P] int32 (the
    logits row of processed row p), mask_of [P] int32 (its row of words, -1: none), words [K,W]
    int32 grammar bitmasks, the penalties' edits (at [E] int32 flat indices, r and c [E] fp32),
    and whether some row needs the rarely used per-row edits (processors._per_row)."""

    index: torch.Tensor
    mask_of: torch.Tensor
    words: torch.Tensor
    at: torch.Tensor
    r: torch.Tensor
    c: torch.Tensor
    per_row: bool

    @property
    def mask_only(self) -> bool:
        """Only grammar masks apply: ops/processing.mask_pick can pick the tokens in one pass."""
        return not self.per_row and self.at.numel() == 0


def stage(table: torch.Tensor, rows: list[int], procs: list[Processor], grammars=None,
          staging: Staging | None = None) -> Staged:
    """Plan the processing of table's rows [P of R, V] on the host (grammar masks filled, the
    penalties' edits listed) before anything waits for the table, so on a GPU that work runs while
    the step's forward does, then copy it to the device in one transfer."""
    vocab = table.shape[-1]
    num = len(rows)
    if num * vocab >= 2**31:
        raise RuntimeError(f"{num} processed rows of {vocab} logits overflow int32 indices")
    words_n = (vocab + 31) // 32
    constrained = [p for p, proc in enumerate(procs) if proc.constrained]
    edits = [_edits(proc) for proc in procs]
    num_edits = sum(len(e[0]) for e in edits)
    lay = (staging or Staging(False)).layout(num, len(constrained), words_n, num_edits,
                                             table.device)
    host = lay.host
    host[:num] = rows
    host[num:2 * num] = -1
    host[[num + p for p in constrained]] = range(len(constrained))
    if constrained:
        _fill_masks([procs[p] for p in constrained], lay.words, grammars)
    at = 2 * num + len(constrained) * words_n
    for p, (ids, r, c) in enumerate(edits):
        n = len(ids)
        if not n:
            continue
        host[at: at + n] = ids + p * vocab
        lay.floats[at + num_edits: at + num_edits + n] = r
        lay.floats[at + 2 * num_edits: at + 2 * num_edits + n] = c
        at += n
    lay.send()
    return Staged(*lay.views, any(_has_row_edits(proc) for proc in procs))


def process(table: torch.Tensor, rows: list[int], procs: list[Processor], grammars=None,
            staging: Staging | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the processed rows [P,V] fp32 of the logits table [R,V], rows as an int32 tensor [P] on
    the table's device): row p is table[rows[p]] as procs[p] changes it (table untouched). The
    host plans first (stage), then two kernels (ops/processing.py) and the per-row edits."""
    s = stage(table, rows, procs, grammars, staging)
    return processed_rows(table, s, procs), s.index


def processed_rows(table: torch.Tensor, s: Staged, procs: list[Processor]) -> torch.Tensor:
    """The staged rows of table processed: [P,V] fp32 copies (table untouched)."""
    out = mask_rows(table, s.index, s.mask_of, s.words)
    if s.per_row:
        _per_row(out, procs)
    penalize(out, s.at, s.r, s.c)
    return out


def apply(rows: torch.Tensor, procs: list[Processor], grammars=None) -> torch.Tensor:
    """rows [P,V] (row i is procs[i]'s logits) -> the processed rows [P,V] fp32 (a copy)."""
    return process(rows, list(range(rows.shape[0])), procs, grammars)[0]


def _fill_masks(procs: list[Processor], words: torch.Tensor, grammars) -> None:
    """Each constrained row's allowed tokens into words [K,W]: its matcher's next-token bitmask
    (several matchers filled on xgrammar's threads), or only the stop tokens once the grammar is
    complete."""
    live = [k for k, proc in enumerate(procs) if not proc.matcher.is_terminated()]
    grammars.fill([procs[k].matcher for k in live], words, live)
    for k, proc in enumerate(procs):
        if proc.matcher.is_terminated():
            words[k] = 0
            _allow(words[k], proc.stop_list)


def _per_row(rows: torch.Tensor, procs: list[Processor]) -> None:
    """allowed_token_ids, bad words, min_tokens and logit_bias: rarely used, row by row."""
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


def _has_row_edits(proc: Processor) -> bool:
    """Whether _per_row changes this row (its checks, without the work)."""
    return (proc.banned is not None or bool(proc.bad_words) or proc.bias is not None
            or proc.num_out < proc.params.min_tokens)


def _edits(proc: Processor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The penalties of one row as edits (token ids [E], repetition factor r [E], subtrahend c
    [E] fp32): x -> where(x > 0, x / r, x * r) - c. Every output token is in the repetition set,
    so with repetition on its ids cover the counted ones."""
    p = proc.params
    counted = proc.counts if proc.counts and (p.frequency_penalty or p.presence_penalty) else None
    if proc.repeated:
        ids = proc.repeated_ids()
        r = np.full(len(ids), p.repetition_penalty, np.float32)
    elif counted:
        ids = np.fromiter(counted, np.int64, len(counted))
        r = np.ones(len(ids), np.float32)
    else:
        return _NO_EDITS
    c = np.zeros(len(ids), np.float32)
    if counted:
        keys = np.fromiter(counted, np.int64, len(counted))
        n = np.fromiter(counted.values(), np.float32, len(counted))
        at = np.searchsorted(ids, keys) if proc.repeated else np.arange(len(keys))
        c[at] = np.float32(p.frequency_penalty) * n + np.float32(p.presence_penalty)
    return ids, r, c


_NO_EDITS = np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros(0, np.float32)


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
