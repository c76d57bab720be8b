"""SpeculativeConfig: which drafter, how many drafts, the n-gram lookup and the adaptive off-switch.

Field names follow vLLM's `speculative_config` (method, num_speculative_tokens, prompt_lookup_max,
prompt_lookup_min); the rest are ours. Speculation is off unless a config is given.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from deltaserve.errors import RequestError

METHODS = ("ngram", "mtp")
ROLLBACKS = ("keep", "recompute")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4  # drafts verified per step (k)
    prompt_lookup_max: int = 4  # n-gram: longest suffix matched against the context
    prompt_lookup_min: int = 2  # n-gram: shortest suffix worth a match
    # adaptive: a request stops drafting once it has drafted adaptive_min_drafts tokens and
    # accepted fewer than adaptive_min_acceptance of them (a losing drafter costs verify rows)
    adaptive: bool = True
    adaptive_min_drafts: int = 16
    adaptive_min_acceptance: float = 0.25
    # pace (with adaptive): drafting continues only while decode steps with drafts emit more
    # tokens per second than steps without, both measured as the engine runs (spec/pace.py)
    pace: bool = True
    # GDN rollback after a rejection: "keep" copies each verified position's state out and copies
    # the accepted one back; "recompute" copies the state once and re-runs the accepted tokens'
    # recurrence steps (spec/rollback.py). Measured on CPU, k=4, 0.8B shape bf16 (a verify step,
    # ms): all drafts right 283 keep / 249 recompute, one right 292 / 271; tiny: equal within
    # noise (docs/benchmarks/2026-11-30-cpu-spec-rollback-*.json). The k state copies per layer
    # cost more than an occasional re-run of the recurrence.
    rollback: str = "recompute"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise RequestError(f"speculative method must be one of {', '.join(METHODS)}, got "
                               f"{self.method!r}")
        if self.rollback not in ROLLBACKS:
            raise RequestError(f"speculative rollback must be one of {', '.join(ROLLBACKS)}, got "
                               f"{self.rollback!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                     "adaptive_min_drafts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise RequestError(f"speculative {name} must be a positive integer, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise RequestError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                               f"prompt_lookup_max ({self.prompt_lookup_max})")
        if not 0.0 <= self.adaptive_min_acceptance <= 1.0:
            raise RequestError("adaptive_min_acceptance must be in [0, 1], got "
                               f"{self.adaptive_min_acceptance}")

    @property
    def needs_hidden(self) -> bool:
        """Every step carries its rows' final hidden states (StepLogits.hidden): the MTP
        drafter's input (the engine's runner keeps them; ModelRunner keep_hidden)."""
        return self.method == "mtp"

    @classmethod
    def from_value(cls, value: SpeculativeConfig | dict[str, Any] | str | None
                   ) -> SpeculativeConfig | None:
        """None (off), a config, a method name, or vLLM's dict ({"method": "ngram",
        "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2, ...})."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            return cls(method=value)
        if not isinstance(value, dict):
            raise RequestError(f"speculative_config must be a dict, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise RequestError(f"unknown speculative_config keys: {', '.join(unknown)} (known: "
                               f"{', '.join(sorted(known))})")
        return cls(**value)


def from_cli(method: str | None, num_tokens: int | None, config_json: str | None
             ) -> dict[str, Any] | None:
    """--speculative, --num-speculative-tokens and --speculative-config JSON as one dict (None:
    off); the two flags override the JSON's keys."""
    import json

    config: dict[str, Any] = {}
    if config_json:
        try:
            config = json.loads(config_json)
        except json.JSONDecodeError as exc:
            raise RequestError(f"--speculative-config is not valid JSON: {exc}") from exc
        if not isinstance(config, dict):
            raise RequestError("--speculative-config must be a JSON object")
    if method is not None:
        config["method"] = method
    if num_tokens is not None:
        config["num_speculative_tokens"] = num_tokens
    if not config:
        return None
    if "method" not in config:
        raise RequestError("speculative decoding needs a method: --speculative ngram|mtp")
    SpeculativeConfig.from_value(config)  # a bad value fails here, before any model loads
    return config


def draftable(live) -> bool:
    """A live request drafts unless it asks for logprobs (those come from plain decode rows), has
    its logits processed (penalties, grammars: processors.py), or samples with a seed: speculative
    sampling (spec/sampled.py) draws another random stream whose length depends on the pace
    gate's timing and on the batch, so a seeded request decodes plainly and stays reproducible."""
    if live is None or live.params.logprobs is not None or live.proc is not None:
        return False  # processed logits (penalties, grammars) follow the plain decode rows
    return live.params.greedy or live.params.seed is None
