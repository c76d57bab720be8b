"""Engines with and without speculation on the same model, and a step-by-step driver."""

from __future__ import annotations

import pytest

from deltaserve.cache.manager import CacheConfig
from deltaserve.engine.engine import Engine, EngineConfig
from deltaserve.engine.sampling import SamplingParams
from deltaserve.engine.scheduler import SchedulerConfig


def greedy(max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def make_engine(llm, spec=None, num_slots=4, num_blocks=96, block_len=16, prefix_bytes=0,
                budget=256) -> Engine:
    """An engine on llm's model; spec: a SpeculativeConfig (None: off)."""
    cfg = EngineConfig(SchedulerConfig(max_num_seqs=num_slots, max_num_batched_tokens=budget,
                                       max_prefill_chunk=budget),
                       CacheConfig(num_slots=num_slots, num_blocks=num_blocks, block_len=block_len,
                                   prefix_budget_bytes=prefix_bytes),
                       speculative=spec)
    return Engine(llm.model, llm.tokenizer, llm.eos_token_ids, llm.max_model_len, cfg, "spec",
                  llm.model_dir)


@pytest.fixture(scope="session")
def tiny_bf16_llm(tiny_dir):
    """bf16 weights, fp32 activations: the CPU path whose rows are bit-exact (spec/rollback.py)."""
    from deltaserve import LLM

    return LLM(tiny_dir, dtype="bfloat16")


@pytest.fixture(scope="session")
def default_bf16_llm():
    from deltaserve import LLM

    return LLM(None, dtype="bfloat16")
