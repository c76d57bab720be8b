"""tokenizer.json via `tokenizers`, the checkpoint's chat template, and streaming detokenization."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from deltaserve.errors import CheckpointError


class Tokenizer:
    """Encode/decode with the checkpoint's tokenizer.json; carries its chat template and specials."""

    def __init__(self, model_dir: Path) -> None:
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"tokenizer.json not found in {model_dir}")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises plain Exception subclasses
            raise CheckpointError(f"tokenizer.json in {model_dir} cannot be read: {exc}") from exc
        self.config = _read_optional_json(model_dir / "tokenizer_config.json")
        self.chat_template = _chat_template(model_dir, self.config)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._plain_tok: HFTokenizer | None = None  # built on first use (encode_chat)
        specials = sorted((t.content for t in self._tok.get_added_tokens_decoder().values()
                           if t.special), key=len, reverse=True)
        self.special_tokens: tuple[str, ...] = tuple(specials)
        self.special_pattern = re.compile("|".join(map(re.escape, specials))) if specials else None

    @property
    def backend(self) -> HFTokenizer:
        """The `tokenizers` object (the grammar engine reads its vocabulary)."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        """Raw text to ids; special-token strings in the text are recognised (chat prompts use them).

        Through encode_batch, which releases the GIL while Rust works (encode holds it: a long
        prompt tokenized on a worker thread would stall the server's event loop for seconds)."""
        return self._tok.encode_batch([text], add_special_tokens=False)[0].ids

    def encode_chat(self, text: str, markers: dict[str, str]) -> list[int]:
        """A rendered chat prompt to ids (chat.ChatText): special-token strings in `text` are the
        template's and become control tokens; each marker stands for a special-token string that
        came from a message and is encoded as plain text. Encoding the pieces between special
        tokens apart is what encode() does anyway (added tokens split the text first)."""
        if not markers or self.special_pattern is None:
            return self.encode(text)
        if self._plain_tok is None:
            self._plain_tok = HFTokenizer.from_str(self._tok.to_str())
            self._plain_tok.encode_special_tokens = True
        pieces, ids, at = [], [], 0
        for match in self.special_pattern.finditer(text):
            pieces.append((text[at:match.start()], None))
            pieces.append((None, self._tok.token_to_id(match.group())))
            at = match.end()
        pieces.append((text[at:], None))
        plain = [_unmark(piece, markers) for piece, _ in pieces if piece]
        encoded = iter(self._plain_tok.encode_batch(plain, add_special_tokens=False))
        for piece, token in pieces:
            if token is not None:
                ids.append(token)
            elif piece:
                ids.extend(next(encoded).ids)
        return ids

    @functools.cached_property
    def longest_token_chars(self) -> int:
        """The most characters of text any one token stands for (a byte-level BPE vocabulary
        spells each byte as one character): a text longer than max_model_len times this cannot
        fit the context (server/prepare.py's bound)."""
        return max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        from deltaserve.chat import render_chat

        return render_chat(self, messages, add_generation_prompt=add_generation_prompt, **kwargs)


def _unmark(text: str, markers: dict[str, str]) -> str:
    for marker, original in markers.items():
        text = text.replace(marker, original)
    return text


def _read_optional_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path.name} is not valid JSON: {path}") from exc
    return data if isinstance(data, dict) else {}


def _chat_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    file = model_dir / "chat_template.jinja"
    if file.is_file():
        return file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # older files store named templates
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class StreamDecoder:
    """Incremental detokenizer: emits text only once it no longer ends in a partial UTF-8 character.

    Decodes a short window (prefix_offset..end) rather than the whole sequence so each step is O(1).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], self.skip)
        full = self.tokenizer.decode(self.ids[self.prefix_offset :], self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back at the end (a genuinely invalid byte sequence stays U+FFFD)."""
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], self.skip)
        full = self.tokenizer.decode(self.ids[self.prefix_offset :], self.skip)
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :]
