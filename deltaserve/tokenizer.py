"""tokenizer.json via `tokenizers`, the checkpoint's chat template, and streaming detokenization."""

from __future__ import annotations

import json
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

    def encode(self, text: str) -> list[int]:
        """Raw text to ids; special-token strings in the text are recognised (chat prompts use them)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        from deltaserve.chat import render_chat

        return render_chat(self, messages, add_generation_prompt=add_generation_prompt, **kwargs)


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
