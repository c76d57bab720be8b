"""Speculation only while it is measured to pay: the engine's decode steps with drafts and without
are timed, and drafting continues only while steps with drafts emit more tokens per second.

Acceptance alone does not decide it: whether k accepted drafts repay a verify step depends on what
a verify step costs against a decode step on this device and model (on the CPU one native call
decodes a token while verify rows run layer by layer in Python; on a GPU decode replays a CUDA
graph while verify runs eagerly). Rates are moving averages over steps made only of decode chunks
(a prefill chunk makes a step incomparable), kept apart per number of sequences in the step (a
batch of 8 and a single sequence pay differently). While one way is chosen, every probe_every-th
such step runs the other way, so a change (longer contexts, other prompts) is noticed; a step the
drafter could not fill counts as a plain one. Steps with prefill chunks follow the choice of the
last decode-only step.

Determinism: where verify rows compute the bits decode rows do (the CPU native kernels on bf16 or
quantized weights; spec/rollback.py), greedy tokens never depend on the choice. Where they do not
(CUDA, fp32 weights on CPU), speculation can already flip a near-tie, and with pacing which steps
draft depends on timing, so two runs may differ there; `pace=False` keeps them repeatable.
"""

from __future__ import annotations


class _Way:
    """The measured rates for one number of sequences per step."""

    __slots__ = ("rates", "num_seen", "drafting", "num_steps")

    def __init__(self) -> None:
        self.rates: dict[bool, float | None] = {True: None, False: None}  # tokens/s per way
        self.num_seen = {True: 0, False: 0}
        self.drafting, self.num_steps = True, 0


class PaceGate:
    """Chooses, per decode-only step, whether the speculator drafts."""

    def __init__(self, probe_every: int = 16, warmup_steps: int = 8, alpha: float = 0.25) -> None:
        self.probe_every, self.warmup_steps, self.alpha = probe_every, warmup_steps, alpha
        self.ways: dict[int, _Way] = {}
        self.drafting = True  # the last decode-only step's choice (steps with prefill follow it)
        self.num_switches = 0

    def choose(self, num_seqs: int = 1) -> bool:
        """Whether this decode-only step of num_seqs sequences drafts: a way without a rate yet
        (drafts first), then alternating up to warmup_steps, then the faster way, except every
        probe_every-th step."""
        way = self.ways.setdefault(num_seqs, _Way())
        way.num_steps += 1
        if way.rates[True] is None or way.rates[False] is None:  # the unmeasured way
            choice = way.rates[True] is None
        elif way.num_steps <= self.warmup_steps:
            choice = way.num_steps % 2 == 1
        else:
            choice = way.drafting != (way.num_steps % self.probe_every == 0)
        self.drafting = way.drafting
        return choice

    def record(self, drafted: bool, num_tokens: int, seconds: float, num_seqs: int = 1) -> None:
        """A decode-only step ran (with drafts or not) and emitted num_tokens in seconds."""
        way = self.ways.setdefault(num_seqs, _Way())
        way.num_seen[drafted] += 1
        if way.num_seen[drafted] == 1:  # a way's first step carries one-time costs: not a rate
            return
        rate = num_tokens / max(seconds, 1e-9)
        old = way.rates[drafted]
        way.rates[drafted] = rate if old is None else old + self.alpha * (rate - old)
        if None not in way.rates.values() and way.num_steps >= self.warmup_steps:
            faster = way.rates[True] > way.rates[False]
            self.num_switches += faster != way.drafting
            way.drafting = self.drafting = faster

    def as_dict(self) -> dict:
        def rates(way: _Way) -> dict:
            return {("draft" if k else "plain"): None if v is None else round(v, 1)
                    for k, v in way.rates.items()}

        return {"drafting": self.drafting, "num_switches": self.num_switches,
                "tok_s": {n: rates(w) for n, w in sorted(self.ways.items())}}
