"""Training batches: random windows of the token stream, plus needle-retrieval episodes."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from deltaserve.bench import needle


@dataclass
class NeedleTokens:
    """Pre-tokenized pieces of the needle format and a per-token 'ends a line' table."""

    encode: object
    eos_id: int
    ends_line: np.ndarray  # bool [V]
    question: np.ndarray

    @classmethod
    def build(cls, tokenizer) -> NeedleTokens:
        vocab = tokenizer.get_vocab_size()
        ends = np.array([tokenizer.decode([i]).endswith("\n") for i in range(vocab)], dtype=bool)

        def encode(text: str) -> np.ndarray:
            return np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)

        eos = tokenizer.token_to_id("<|endoftext|>")
        return cls(encode, eos, ends, encode(needle.QUESTION))


def _line_aligned(filler: np.ndarray, nt: NeedleTokens) -> np.ndarray:
    filler = filler[filler != nt.eos_id]
    cuts = np.nonzero(nt.ends_line[filler])[0]
    return filler[cuts[0] + 1 : cuts[-1] + 1] if cuts.size >= 2 else filler[:0]


def needle_episode(
    stream: np.ndarray, nt: NeedleTokens, filler_len: int, depth: float, key: str, rng
) -> tuple[np.ndarray, int]:
    """[filler .. needle .. filler, question, answer] from the stream; returns (ids, answer_len)."""
    start = int(rng.integers(0, stream.size - filler_len - 1))
    filler = _line_aligned(stream[start : start + filler_len].astype(np.int64), nt)
    lines_end = np.nonzero(nt.ends_line[filler])[0]
    at = 0
    if lines_end.size:
        at = int(lines_end[min(int(depth * lines_end.size), lines_end.size - 1)]) + 1
    answer = nt.encode(needle.answer_text(key))
    ids = np.concatenate([filler[:at], nt.encode(needle.needle_text(key)), filler[at:],
                          nt.question, answer])
    return ids, answer.size


def needle_row(
    stream: np.ndarray, nt: NeedleTokens, seq_len: int, rng, key_rng
) -> tuple[np.ndarray, np.ndarray]:
    """seq_len+1 tokens of back-to-back episodes, filler lengths log-uniform in [32, seq_len-64].

    Many short episodes per row let the copy mechanism form early; the long ones stretch it to
    the full context. Returns (ids, answer mask over the row's label positions).
    """
    parts, answers, total = [], [], 0
    while total < seq_len + 1:
        filler_len = int(np.exp(rng.uniform(np.log(32), np.log(seq_len - 64))))
        ids, answer_len = needle_episode(
            stream, nt, filler_len, float(rng.uniform(0.02, 0.98)), needle.make_key(key_rng), rng
        )
        ids = np.concatenate([[nt.eos_id], ids])
        parts.append(ids)
        total += ids.size
        answers.append((total - answer_len, total))  # answer token span in row coordinates
    row = np.concatenate(parts)
    drop = row.size - (seq_len + 1)
    mask = np.zeros(row.size, dtype=bool)
    for a, b in answers:
        mask[a:b] = True
    # label position p predicts token p+1: the mask over labels is the token mask shifted by one
    return row[drop:], mask[drop + 1 :]


def _fill_row(seq_len: int, episode) -> np.ndarray:
    """seq_len+1 tokens of back-to-back `episode()` arrays, the last one cut."""
    parts, total = [], 0
    while total < seq_len + 1:
        parts.append(episode())
        total += parts[-1].size
    return np.concatenate(parts)[: seq_len + 1]


def repeat_row(stream: np.ndarray, eos_id: int, seq_len: int, rng) -> np.ndarray:
    """seq_len+1 tokens of [EOS, chunk, chunk] episodes: every second copy is exactly predictable
    by looking back, the dense signal that makes in-context copying (induction) form early."""

    def episode() -> np.ndarray:
        n = int(np.exp(rng.uniform(np.log(16), np.log(512))))
        start = int(rng.integers(0, stream.size - n))
        chunk = stream[start : start + n].astype(np.int64)
        return np.concatenate([[eos_id], chunk, chunk])

    return _fill_row(seq_len, episode)


def random_repeat_row(nt: NeedleTokens, seq_len: int, rng) -> np.ndarray:
    """seq_len+1 tokens of [EOS, s, newline, s] episodes, s a random key-alphabet string: copying
    text that no n-gram statistics predict, the exact skill a needle answer needs."""

    def episode() -> np.ndarray:
        n_chars = int(rng.integers(6, 64))
        ids = nt.encode("".join(rng.choice(list(needle.KEY_CHARS), n_chars)))
        return np.concatenate([[nt.eos_id], ids, nt.encode("\n"), ids])

    return _fill_row(seq_len, episode)


def make_batch(
    stream_gpu: torch.Tensor,
    stream_np: np.ndarray,
    nt: NeedleTokens,
    batch: int,
    seq_len: int,
    num_needle: int,
    rng: np.random.Generator,
    key_rng: random.Random,
    num_repeat: int = 0,
    single_episode: bool = False,
    num_random_repeat: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B, T+1], answer mask [B, T] over label positions) on the stream's device.

    Rows [0, num_needle) are needle rows, then num_repeat repeat rows, then num_random_repeat
    random-string repeat rows; the rest are plain text.
    """
    device = stream_gpu.device
    starts = torch.randint(0, stream_gpu.numel() - seq_len - 1, (batch,), device=device)
    tokens = stream_gpu[starts[:, None] + torch.arange(seq_len + 1, device=device)]
    mask = torch.zeros(batch, seq_len, dtype=torch.bool, device=device)
    for row in range(num_needle):
        if single_episode:  # stage 1's recipe: one episode at the end of a text row
            ids, answer_len = needle_episode(
                stream_np, nt, int(rng.integers(256, seq_len - 64)), float(rng.uniform(0.02, 0.98)),
                needle.make_key(key_rng), rng,
            )
            ids = np.concatenate([[nt.eos_id], ids])[-(seq_len + 1) :]
            tokens[row, -ids.size :] = torch.from_numpy(ids).to(device)
            mask[row, seq_len - answer_len :] = True
            continue
        ids, answer_mask = needle_row(stream_np, nt, seq_len, rng, key_rng)
        tokens[row] = torch.from_numpy(ids).to(device)
        mask[row] = torch.from_numpy(answer_mask).to(device)
    for row in range(num_needle, num_needle + num_repeat):
        tokens[row] = torch.from_numpy(repeat_row(stream_np, nt.eos_id, seq_len, rng)).to(device)
    first = num_needle + num_repeat
    for row in range(first, first + num_random_repeat):
        tokens[row] = torch.from_numpy(random_repeat_row(nt, seq_len, rng)).to(device)
    return tokens, mask


def eval_needles(
    stream_np: np.ndarray, nt: NeedleTokens, seq_len: int, num: int, depth: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed set of needle episodes of exactly seq_len+1 tokens at one depth (teacher-forced eval)."""
    rng, key_rng = np.random.default_rng(seed), random.Random(seed)
    rows, masks = [], []
    for _ in range(num):
        ids, answer_len = needle_episode(stream_np, nt, seq_len - 40, depth,
                                         needle.make_key(key_rng), rng)
        ids = ids[-(seq_len + 1):]
        pad = np.full(seq_len + 1 - ids.size, nt.eos_id)
        rows.append(np.concatenate([pad, ids]))
        mask = np.zeros(seq_len, dtype=bool)
        mask[seq_len - answer_len :] = True
        masks.append(mask)
    return torch.from_numpy(np.stack(rows)), torch.from_numpy(np.stack(masks))
