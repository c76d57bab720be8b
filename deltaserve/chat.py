"""Chat prompts rendered with the checkpoint's jinja template in a sandboxed environment."""

from __future__ import annotations

import functools
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
