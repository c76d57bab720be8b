"""Request bodies of the OpenAI API as pydantic models: wrong types and unknown values become
400s in the OpenAI error shape (server/errors.py), never FastAPI's default 422."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from deltaserve.engine.sampling import MAX_LOGPROBS

MAX_STOP_STRINGS = 16
MAX_CHOICES = 16  # n: each choice is a sequence slot


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... are passed to the template
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def template_content(self) -> str | list[dict[str, Any]]:
        """The content as the chat template takes it: text, or checked parts (text and
        image_url; an image_url is a data: URL, as a string or {"url": ...})."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts: list[dict[str, Any]] = []
        for part in self.content:
            kind = part.get("type")
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str):
                    raise ValueError("an image_url part needs image_url.url (a data: URL)")
                parts.append({"type": "image_url", "image_url": {"url": url}})
            else:
                raise ValueError(f"content part type {kind!r} is not supported (text, "
                                 "image_url)")
        return parts


class _Sampling(BaseModel):
    """Fields shared by chat and text completions (non-OpenAI extras as vLLM names them)."""

    model_config = ConfigDict(extra="ignore")
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)  # choices: n engine requests, one prompt
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise ValueError(f"stop takes up to {MAX_STOP_STRINGS} non-empty strings")
        return stops




class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's per-request processor options; images take {"downsample_mode": "16x" | "4x"}
    mm_processor_kwargs: dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def num_logprobs(self) -> int | None:
        """None: no logprobs; else how many alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def token_limit(self) -> int | None:
        """max_completion_tokens wins over max_tokens when both are given (as llama-server)."""
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[int] = Field(min_length=1)
    # the OpenAI default; 0 with echo scores the prompt only (lm-evaluation-harness)
    max_tokens: int | None = Field(default=16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def token_limit(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        return self.logprobs


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]
