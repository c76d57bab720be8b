"""Speculation only while it is measured to pay: the engine's decode steps with drafts and without
are timed, and drafting continues only while steps with drafts emit more tokens per second.

Acceptance alone does not decide it: whether k accepted drafts repay a verify step depends on what
a verify step costs against a decode step on this device and model (on the CPU one native call
decodes a token while verify rows run layer by layer in Python; on a GPU decode replays a CUDA
graph while verify runs eagerly). Both rates are moving averages over steps made only of decode
chunks (a prefill chunk makes a step incomparable). While one way is chosen, every probe_every-th
such step runs the other way, so a change (longer contexts, a different batch) is noticed; a step
the drafter could not fill counts as a plain one. Greedy tokens do not depend on the choice.
"""

from __future__ import annotations


class PaceGate:
    """Chooses, per decode-only step, whether the speculator drafts."""

    def __init__(self, probe_every: int = 16, warmup_steps: int = 8, alpha: float = 0.25) -> None:
        self.probe_every, self.warmup_steps, self.alpha = probe_every, warmup_steps, alpha
        self.rates: dict[bool, float | None] = {True: None, False: None}  # tokens/s per way
        self.num_seen = {True: 0, False: 0}
        self.drafting = True
        self.num_steps = 0
        self.num_switches = 0

    def choose(self) -> bool:
        """Whether this decode-only step drafts: a way without a rate yet (drafts first), then
        alternating up to warmup_steps, then the faster way, except every probe_every-th step."""
        self.num_steps += 1
        if self.rates[True] is None or self.rates[False] is None:  # the unmeasured way
            return self.rates[True] is None
        if self.num_steps <= self.warmup_steps:
            return self.num_steps % 2 == 1
        return self.drafting != (self.num_steps % self.probe_every == 0)

    def record(self, drafted: bool, num_tokens: int, seconds: float) -> None:
        """A decode-only step ran (with drafts or not) and emitted num_tokens in seconds."""
        self.num_seen[drafted] += 1
        if self.num_seen[drafted] == 1:  # a way's first step carries one-time costs: not a rate
            return
        rate = num_tokens / max(seconds, 1e-9)
        old = self.rates[drafted]
        self.rates[drafted] = rate if old is None else old + self.alpha * (rate - old)
        if None not in self.rates.values() and self.num_steps >= self.warmup_steps:
            faster = self.rates[True] > self.rates[False]
            self.num_switches += faster != self.drafting
            self.drafting = faster

    def as_dict(self) -> dict:
        rates = {("draft" if k else "plain"): None if v is None else round(v, 1)
                 for k, v in self.rates.items()}
        return {"drafting": self.drafting, "tok_s": rates, "num_switches": self.num_switches}
