"""Bounded work before admission, off the event loop: request bodies parsed and checked, prompts
rendered, measured and tokenized on worker threads, so that no request (a 30 MB prompt, JSON
nested 100k deep) stalls /health or anyone else's stream.

- Bodies: JSON parsed on a worker; nesting beyond MAX_JSON_DEPTH and lone surrogates (valid JSON
  escapes, "\\ud800", but not text: no tokenizer or response encoder takes them) are 400s before
  any handler sees the body.
- Prompts: a text longer than the context can hold (max_model_len tokens times the most
  characters one token stands for, or --max-prompt-chars) is refused before it is tokenized;
  tokenization releases the GIL (Tokenizer.encode).
- Two pools: bodies over LARGE_BYTES queue behind each other on their own worker, so a few huge
  requests cannot hold up the small ones.
"""

from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import ThreadPoolExecutor

from pydantic import BaseModel, ValidationError

from deltaserve.server.errors import ApiError, validation_message

MAX_JSON_DEPTH = 64  # OpenAI-shaped bodies nest a handful of levels; tool schemas a few more
LARGE_BYTES = 64 << 10
_SURROGATE = re.compile("[\ud800-\udfff]")


class Preparer:
    def __init__(self, max_prompt_chars: int | None = None, small_workers: int = 4) -> None:
        """max_prompt_chars: None = derived from each model's context (prompt_chars_limit)."""
        if max_prompt_chars is not None and max_prompt_chars < 1:
            raise ValueError("max_prompt_chars must be positive")
        self.max_prompt_chars = max_prompt_chars
        self._small = ThreadPoolExecutor(small_workers, "deltaserve-prepare")
        self._large = ThreadPoolExecutor(1, "deltaserve-prepare-large")

    async def run(self, size: int, fn, /, *args):
        """fn(*args) on a worker (the large requests' one when size > LARGE_BYTES)."""
        pool = self._large if size > LARGE_BYTES else self._small
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    def shutdown(self) -> None:
        self._small.shutdown(wait=False, cancel_futures=True)
        self._large.shutdown(wait=False, cancel_futures=True)

    def prompt_chars_limit(self, llm) -> int:
        return self.max_prompt_chars or llm.max_model_len * llm.tokenizer.longest_token_chars

    def check_chars(self, llm, text: str, param: str) -> None:
        """A text that cannot fit the context is refused before tokenizing (no token of this
        vocabulary stands for more than longest_token_chars characters)."""
        limit = self.prompt_chars_limit(llm)
        if len(text) > limit:
            why = ("--max-prompt-chars" if self.max_prompt_chars else
                   f"no {llm.max_model_len} tokens of this vocabulary hold more")
            raise ApiError(400, f"This model's maximum context length is {llm.max_model_len} "
                           f"tokens; the prompt has {len(text)} characters and at most {limit} "
                           f"are accepted ({why})", "context_length_exceeded", param)

    async def body(self, request, model: type[BaseModel]) -> tuple[BaseModel, int]:
        """The request body validated as `model`, and its size in bytes."""
        raw = await request.body()
        return await self.run(len(raw), parse_body, raw, model), len(raw)


def parse_body(raw: bytes, model: type[BaseModel]) -> BaseModel:
    """JSON -> checked tree -> the pydantic model; every failure an ApiError 400."""
    try:
        data = json.loads(raw)
    except RecursionError as exc:
        raise ApiError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels",
                       "invalid_json") from exc
    except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8
        raise ApiError(400, "the request body is not valid JSON", "invalid_json") from exc
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", "invalid_request")
    check_tree(data)
    return validated(model, data)


def validated(model: type[BaseModel], data: dict) -> BaseModel:
    """data as `model`; a failure is the 400 naming the first bad field (the other APIs' bodies
    become chat requests through this too: server/anthropic.py, server/responses.py)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        message, where = validation_message(exc.errors())
        raise ApiError(400, message, "invalid_request", where) from exc


def check_tree(data) -> None:
    """Depth at most MAX_JSON_DEPTH; no lone surrogate in any string or key (iterative: a deep
    tree never recurses here)."""
    stack = [(data, 1, "body")]
    while stack:
        value, depth, where = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels",
                           "invalid_json")
        if isinstance(value, str):
            if _SURROGATE.search(value):
                raise ApiError(400, f"{where}: the text holds a lone UTF-16 surrogate (an "
                               "unpaired \\ud800-\\udfff escape), which is not a character",
                               "invalid_request", where)
        elif isinstance(value, dict):
            for key, item in value.items():
                path = key if where == "body" else f"{where}.{key}"
                stack.append((key, depth, where))
                stack.append((item, depth + 1, path))
        elif isinstance(value, list):
            stack.extend((item, depth + 1, where) for item in value)
