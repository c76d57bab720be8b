"""Request bodies of the OpenAI API as pydantic models: wrong types and unknown values become
400s in the OpenAI error shape (server/errors.py), never FastAPI's default 422."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

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
        if all(p["type"] == "text" for p in parts):  # as vLLM: one string, parts on lines
            return "\n".join(p["text"] for p in parts)
        return parts


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, json_object, or json_schema {name, schema, strict}."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None

    @field_validator("json_schema")
    @classmethod
    def _schema(cls, v):
        if v is not None and not isinstance(v.get("schema", {}), dict | bool):
            raise ValueError("json_schema.schema must be a JSON schema object")
        return v


class _Sampling(BaseModel):
    """Fields shared by chat and text completions (non-OpenAI extras as vLLM names them). A
    field not declared here is a 400 naming it (nothing is accepted and ignored)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None  # optional: one model is served (any of its names is accepted)
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
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    logit_bias: dict[str, float] | None = None  # token id (as text) -> -100..100
    min_tokens: int = Field(default=0, ge=0)
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_* names
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: Literal["xgrammar", "auto"] | None = None
    # sent by OpenAI clients, no effect on generation here (listed in the README)
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        for key, value in (v or {}).items():
            if not key.lstrip("-").isdecimal():
                raise ValueError(f"logit_bias keys are token ids, got {key!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value}")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise ValueError(f"stop takes up to {MAX_STOP_STRINGS} non-empty strings")
        return stops


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class _NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: _NamedFunction


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's per-request processor options; images take {"downsample_mode": "16x" | "4x"}
    mm_processor_kwargs: dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _checks(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice 'required' or a named function needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name \
                not in {t.function.name for t in self.tools or ()}:
            raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is "
                             "not among the tools")
        return self

    def num_logprobs(self) -> int | None:
        """None: no logprobs; else how many alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def token_limit(self) -> int | None:
        """max_completion_tokens wins over max_tokens when both are given (as llama-server)."""
        return self.max_completion_tokens or self.max_tokens


MAX_BATCH_CHOICES = 256  # prompts x n of one completions request: each is a sequence


class CompletionRequest(_Sampling):
    # one text, one token-id list, or a batch of either (vLLM's four forms; lm-eval sends ids)
    prompt: str | list[int] | list[str] | list[list[int]] = Field(min_length=1)
    # the OpenAI default; 0 with echo scores the prompt only (lm-evaluation-harness)
    max_tokens: int | None = Field(default=16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(default=None, ge=1, le=1)  # only 1: one sequence per choice

    @model_validator(mode="after")
    def _batch(self):
        batch = self.prompt if isinstance(self.prompt, list) and not isinstance(
            self.prompt[0], int) else [self.prompt]
        if any(len(one) == 0 for one in batch):
            raise ValueError("prompt: an empty prompt (give text or at least one token id)")
        if len(batch) * self.n > MAX_BATCH_CHOICES:
            raise ValueError(f"prompt: {len(batch)} prompts x n={self.n} choices is over "
                             f"{MAX_BATCH_CHOICES} sequences; split the batch")
        return self

    def token_limit(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        return self.logprobs


class TokenizeRequest(BaseModel):
    """vLLM's (prompt, or messages through the chat template) and llama-server's (content)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    content: str | None = None  # llama-server's name for prompt
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    # no tokenizer of this family adds BOS/EOS: both values give the same ids
    add_special_tokens: bool = True
    add_special: bool = True  # llama-server's name
    return_token_strs: bool = False  # vLLM: token_strs beside tokens
    with_pieces: bool = False  # llama-server: tokens as {id, piece}

    @model_validator(mode="after")
    def _one_input(self):
        given = [n for n in ("prompt", "content", "messages") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of prompt, content (text) or messages (chat)")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]
