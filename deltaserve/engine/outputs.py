"""What generation returns: vLLM-shaped RequestOutput / CompletionOutput, and stream events."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" (EOS, stop id or string), "length", "error" (NaN/inf)
    stop_reason: int | str | None = None  # the stop id or string that ended it, None for EOS/length
    # with SamplingParams.logprobs: per token {token id: logprob}, the sampled token and the top
    # alternatives (vLLM's shape, plain floats)
    logprobs: list[dict[int, float]] | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: dict[str, float] = field(default_factory=dict)  # prefill_s, decode_s, tokens/s
    # with SamplingParams.prompt_logprobs: per prompt position {token id: logprob} (the prompt's
    # token and the top alternatives; None for the first position), as vLLM gives them
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """One step of a streamed generation: newly decodable text and the token ids behind it."""

    text: str
    token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
