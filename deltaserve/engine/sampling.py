"""SamplingParams (vLLM-shaped) and the sampler: greedy, temperature, top-k, top-p, min-p, seed."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deltaserve.errors import RequestError

MAX_LOGPROBS = 20


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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids or ()))
        checks = [
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
        ]
        for ok, message in checks:
            if not ok:
                raise RequestError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(
        params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
    )
    return gen


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """logits [vocab] fp32 -> one token id."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    logits = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = sorted_probs.cumsum(-1)
        drop = cumulative - sorted_probs > params.top_p  # keep the smallest prefix reaching top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=gen).item())


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Row i of logits [R, vocab] after params[i]'s temperature, top-k, min-p and top-p: the
    distribution sample() draws from, unnormalized (filtered entries 0). Row-wise ops only."""
    device = logits.device
    col = lambda xs: torch.tensor(xs, dtype=torch.float32, device=device)[:, None]  # noqa: E731
    x = logits.float() / col([p.temperature for p in params])
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
                gens: list[torch.Generator | None]) -> list[int]:
    """sample() for every row of logits [R, vocab] at once: the filters run on all rows together
    (row-wise ops, so each row gets exactly sample()'s numbers), each row draws from its own
    generator, and the tokens come back in one device-to-host copy instead of one per row."""
    if any(p.greedy for p in params):
        raise ValueError("sample_rows takes sampling rows only; greedy rows are one argmax")
    probs = filtered_probs(logits, params)
    draws = [torch.multinomial(probs[i] / probs[i].sum(), 1, generator=gens[i])
             for i in range(len(params))]
    return torch.cat(draws).tolist()
