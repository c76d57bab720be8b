"""SamplingParams (vLLM-shaped) and the sampler: greedy, temperature, top-k, top-p, min-p, seed.
Penalties, logit bias, token bans and grammars change a request's logits before this sampler sees
them (engine/processors.py).

Every accepted parameter gives a valid distribution: logits are shifted by their row maximum
before the temperature divides them (a temperature of 1e-38 turns the row into a point mass on its
maximum instead of overflowing to inf / NaN), and a temperature below fp32's smallest normal number
(1e-300 as a Python float is 0 in fp32) is raised to it. A row whose distribution still comes out
invalid is reported, not drawn from: its request fails alone (engine.Engine._sample).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from deltaserve.errors import RequestError
from deltaserve.structured.params import StructuredOutputsParams

MAX_LOGPROBS = 20
MIN_TEMPERATURE = torch.finfo(torch.float32).tiny  # the smallest divisor the sampler uses


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """temperature 0 = greedy. top_k <= 0 and top_p = 1 and min_p = 0 disable those filters."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None = up to the context limit
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # per generated token: its log-probability under the raw model distribution (before
    # temperature and filters, as vLLM reports) and this many most likely alternatives; None = off
    logprobs: int | None = None
    # vLLM's: each prompt token's log-probability given the ones before it, and this many most
    # likely tokens there, computed by the prefill itself (engine/prompt_logprobs.py); None = off
    prompt_logprobs: int | None = None
    # logits processing (engine/processors.py), vLLM's names and ranges
    presence_penalty: float = 0.0  # OpenAI: minus this once a token has appeared in the output
    frequency_penalty: float = 0.0  # OpenAI: minus this times the token's count in the output
    repetition_penalty: float = 1.0  # HF/vLLM: tokens of prompt or output, divided (x > 0) or times
    logit_bias: tuple[tuple[int, float], ...] | None = None  # token id -> added to its logit
    min_tokens: int = 0  # no EOS / stop id / stop string before this many tokens
    bad_words: tuple[str, ...] | None = None  # never generated (each word's token sequences)
    allowed_token_ids: tuple[int, ...] | None = None  # the only tokens that may be generated
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output must match

    def __post_init__(self) -> None:
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(
                (int(k), float(v)) for k, v in self.logit_bias.items()))
        for name in ("bad_words", "allowed_token_ids"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(value))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids or ()))
        checks = [
            (all(math.isfinite(v) for v in (self.temperature, self.top_p, self.min_p)),
             "temperature, top_p and min_p must be finite numbers"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.top_k >= -1, f"top_k must be -1, 0 (off) or positive, got {self.top_k}"),
            (
                self.max_tokens is None or self.max_tokens >= 1,
                f"max_tokens must be >= 1, got {self.max_tokens}",
            ),
            (all(s for s in self.stop), "stop strings must not be empty"),
            (self.seed is None or 0 <= self.seed < 2**63,
             f"seed must be in [0, 2**63), got {self.seed}"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
             f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}"),
            (all(math.isfinite(v) for v in (self.presence_penalty, self.frequency_penalty,
                                             self.repetition_penalty)),
             "presence_penalty, frequency_penalty and repetition_penalty must be finite"),
            (-2 <= self.presence_penalty <= 2,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.repetition_penalty > 0,
             f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (all(math.isfinite(b) and -100 <= b <= 100 for _, b in self.logit_bias or ()),
             "logit_bias values must be in [-100, 100]"),
            (0 <= self.min_tokens, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"),
            (self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
             "allowed_token_ids must not be empty"),
            (all(w for w in self.bad_words or ()), "bad_words must not be empty strings"),
        ]
        for ok, message in checks:
            if not ok:
                raise RequestError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """Whether anything changes this request's logits before sampling (processors.py)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0 or self.min_tokens or self.bad_words
                    or self.allowed_token_ids is not None or self.structured_outputs is not None)


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(
        params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
    )
    return gen


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """logits [vocab] fp32 -> one token id (sample_rows on one row: the same numbers)."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    token = sample_rows(logits[None], [params], [gen])[0]
    if token is None:
        raise RequestError("the sampling distribution is not valid (non-finite logits)")
    return token


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Row i of logits [R, vocab] after params[i]'s temperature, top-k, min-p and top-p: the
    distribution sample() draws from, unnormalized (filtered entries 0). Row-wise ops only."""
    device = logits.device
    col = lambda xs: torch.tensor(xs, dtype=torch.float32, device=device)[:, None]  # noqa: E731
    x = logits.float()
    # shifted first: every entry <= 0 and the maximum exactly 0, so a tiny temperature sends the
    # others to -inf (never inf - inf) and the softmax always has a 1 to normalise by
    x = (x - x.max(-1, keepdim=True).values) / col(
        [p.temperature for p in params]).clamp_min(MIN_TEMPERATURE)
    ks = [p.top_k if 0 < p.top_k < x.shape[-1] else 0 for p in params]
    if any(ks):
        kth = torch.topk(x, max(ks), dim=-1).values[torch.arange(len(ks), device=device),
                                                    torch.tensor([max(k, 1) - 1 for k in ks],
                                                                 device=device)]
        cut = (x < kth[:, None]) & (col(ks) > 0)
        x = x.masked_fill(cut, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    min_ps = [p.min_p for p in params]
    if any(m > 0 for m in min_ps):
        low = probs < col(min_ps) * probs.max(-1, keepdim=True).values
        probs = probs.masked_fill(low & (col(min_ps) > 0), 0.0)
    top_ps = [p.top_p for p in params]
    if any(t < 1 for t in top_ps):
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        drop = sorted_probs.cumsum(-1) - sorted_probs > col(top_ps)
        nucleus = torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill(drop, 0.0))
        probs = torch.where(col(top_ps) < 1, nucleus, probs)
    return probs


def sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                gens: list[torch.Generator | None]) -> list[int | None]:
    """sample() for every row of logits [R, vocab] at once: the filters run on all rows together
    (row-wise ops, so each row gets exactly sample()'s numbers), each row draws from its own
    generator, and the tokens come back in one device-to-host copy instead of one per row. A row
    whose distribution is not valid (non-finite, or nothing left) gets None and draws nothing."""
    if any(p.greedy for p in params):
        raise ValueError("sample_rows takes sampling rows only; greedy rows are one argmax")
    probs = filtered_probs(logits, params)
    total = probs.sum(-1)
    valid = (torch.isfinite(total) & (total > 0)).tolist()
    draws = [torch.multinomial(probs[i] / total[i], 1, generator=gens[i]) if ok else None
             for i, ok in enumerate(valid)]
    kept = [d for d in draws if d is not None]
    tokens = iter(torch.cat(kept).tolist() if kept else ())
    return [None if d is None else next(tokens) for d in draws]
