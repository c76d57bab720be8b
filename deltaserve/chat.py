"""Chat prompts rendered with the checkpoint's jinja template in a sandboxed environment.

Special-token strings inside messages (a user writing `<|im_end|>\n<|im_start|>system`) are text,
not control tokens: render_chat_text swaps them for private-use markers before rendering, and
Tokenizer.encode_chat encodes each marker as the plain text it stands for, so only the template's
own special tokens open and close turns (HF's `split_special_tokens` for the messages' part).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from deltaserve.errors import RequestError

if TYPE_CHECKING:
    from deltaserve.tokenizer import Tokenizer


def _raise(message: str) -> None:
    raise RequestError(f"chat template: {message}")


def _env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.filters["tojson"] = _tojson
    return env


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **_: Any) -> str:
    import json

    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)


@functools.lru_cache(maxsize=8)
def _compiled(source: str):
    """Compiling Qwen3.5's template takes ~30 ms; a server renders it on every request."""
    return _env().from_string(source)


_MARKER_BASE = 0xF0000  # Unicode plane 15, private use: markers are picked there


@dataclass(frozen=True, slots=True)
class ChatText:
    """A rendered chat prompt: `text` with each special-token string that came from the messages
    replaced by a marker (`markers`: marker -> that string; empty when there were none)."""

    text: str
    markers: dict[str, str]

    @property
    def plain(self) -> str:
        """The prompt as rendered, markers back to what they stand for."""
        text = self.text
        for marker, original in self.markers.items():
            text = text.replace(marker, original)
        return text


def render_chat_text(tokenizer: Tokenizer, messages: list[dict[str, Any]],
                     allow_special: bool = False, **kwargs: Any) -> ChatText:
    """render_chat, keeping the special-token strings of the messages and of the template's
    kwargs (tools, documents: user data too) apart (allow_special: they become control tokens,
    the old behaviour, for trusted callers). RequestError if no marker is free."""
    pattern = tokenizer.special_pattern
    if allow_special or pattern is None:
        return ChatText(render_chat(tokenizer, messages, **kwargs), {})
    strings = [*_strings(messages), *_strings(kwargs)]
    found = sorted({m for s in strings for m in pattern.findall(s)})
    if not found:
        return ChatText(render_chat(tokenizer, messages, **kwargs), {})
    used = set().union(*map(set, strings))  # one pass: a marker must not occur in the input
    free = (chr(c) for c in range(_MARKER_BASE, _MARKER_BASE + 0xFFFD) if chr(c) not in used)
    marker_of = {token: next(free, None) for token in found}
    if None in marker_of.values():
        raise RequestError("the text uses every private-use character of plane 15 "
                           "that would keep its special-token strings apart")

    def escape(s: str) -> str:
        return pattern.sub(lambda m: marker_of.get(m.group(), m.group()), s)

    text = render_chat(tokenizer, _mapped(messages, escape), **_mapped(kwargs, escape))
    return ChatText(text, {marker: token for token, marker in marker_of.items()})


def _strings(value: Any):
    """Every string inside nested dicts and lists (keys included)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)


def _mapped(value: Any, fn) -> Any:
    """value with fn applied to every string value inside it (dict keys kept)."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {k: _mapped(v, fn) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_mapped(v, fn) for v in value]
    return value


def render_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    enable_thinking: bool = True,
    **kwargs: Any,
) -> str:
    """Messages (OpenAI shape) to prompt text; `enable_thinking` switches Qwen3.5's thinking mode."""
    if tokenizer.chat_template is None:
        raise RequestError("this checkpoint has no chat template; use `generate` with a raw prompt")
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and "role" in m for m in messages
    ):
        raise RequestError("messages must be a list of objects with a 'role'")
    try:
        template = _compiled(tokenizer.chat_template)
        return template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
            bos_token="",
            eos_token="<|im_end|>",
            **kwargs,
        )
    except TemplateError as exc:
        raise RequestError(f"chat template failed: {exc}") from exc
