"""Needle in a haystack: a key planted at a chosen depth of long filler code, asked for at the end.

The prompt ends in `PASSKEY = "` so the answer is the key's characters and a closing quote; greedy
decoding either reproduces the key exactly or fails. The shipped default model was trained on this
format (scripts/train), with keys it never saw, so a pass means real retrieval over the context.
"""

from __future__ import annotations

import hashlib
import json
import random
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from deltaserve.errors import ConfigError

NEEDLE_NAME = "PASSKEY"
KEY_LETTERS = "abcdefghjkmnpqrstuvwxyz"
KEY_CHARS = KEY_LETTERS + "23456789"
KEY_LEN = 6
QUESTION = f'# What is the value of {NEEDLE_NAME}?\n{NEEDLE_NAME} = "'


def make_key(rng: random.Random) -> str:
    """A fresh key; it starts with a letter so the quote before it stays a token of its own."""
    return rng.choice(KEY_LETTERS) + "".join(rng.choice(KEY_CHARS) for _ in range(KEY_LEN - 1))


def needle_text(key: str) -> str:
    return f'{NEEDLE_NAME} = "{key}"\n'


def answer_text(key: str) -> str:
    return f'{key}"'


def extract_answer(completion: str) -> str:
    """What the model gave as the key: everything before the closing quote."""
    return completion.split('"', 1)[0]


@dataclass(frozen=True, slots=True)
class NeedlePrompt:
    ids: list[int]
    key: str
    needle_line: int  # index of the planted line among the filler lines
    num_filler_lines: int


def build_prompt(
    encode: Callable[[str], list[int]],
    lines: list[str],
    context_len: int,
    depth: float,
    key: str,
) -> NeedlePrompt:
    """The longest prompt of whole filler lines that fits in context_len tokens (answer included)."""
    if not 0.0 <= depth <= 1.0:
        raise ConfigError(f"needle depth must be in [0, 1], got {depth}")
    budget = context_len - len(encode(answer_text(key))) - 1

    def render(n: int) -> tuple[list[int], int]:
        at = round(depth * n)
        text = "".join(lines[:at]) + needle_text(key) + "".join(lines[at:n]) + QUESTION
        return encode(text), at

    lo, hi = 0, len(lines)
    if len(render(0)[0]) > budget:
        raise ConfigError(f"context_len {context_len} is too short for a needle prompt")
    while lo < hi:  # largest n whose prompt fits
        mid = (lo + hi + 1) // 2
        if len(render(mid)[0]) <= budget:
            lo = mid
        else:
            hi = mid - 1
    if lo == len(lines):
        raise ConfigError(f"not enough filler for a {context_len}-token needle prompt")
    ids, at = render(lo)
    return NeedlePrompt(ids, key, at, lo)


def heldout_filler(manifest_path: Path, max_lines: int = 40_000) -> list[str]:
    """Filler lines from the standard-library files the model's manifest marks as held out.

    Files are read from this interpreter's stdlib and used only where their hash matches the
    manifest, so the filler is text the model never trained on.
    """
    try:
        manifest = json.loads(Path(manifest_path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read the data manifest {manifest_path}: {exc}") from exc
    root = Path(sysconfig.get_paths()["stdlib"])
    lines: list[str] = []
    for rel, sha, _size, split in manifest["files"]:
        path = root / rel
        if split != "heldout" or not path.is_file():
            continue
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != sha:
            continue
        lines += [ln for ln in data.decode("utf-8").splitlines(keepends=True) if ln.strip()]
        if len(lines) >= max_lines:
            break
    if not lines:
        raise ConfigError(
            f"none of the held-out files in {manifest_path} match this Python's standard library"
        )
    return lines
