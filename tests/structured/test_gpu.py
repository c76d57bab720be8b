"""Constrained, penalised and free requests in one batch on CUDA with decode graphs: the free
requests' tokens equal those of the same batch shape with no processing (run on the H200)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from deltaserve import SamplingParams
from deltaserve.structured.params import StructuredOutputsParams as S

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_processed_rows_leave_free_rows_alone_under_cuda_graphs(tiny_dir) -> None:
    from deltaserve import LLM

    llm = LLM(tiny_dir, dtype="float32", device="cuda")
    assert llm.engine.runner.graphs is not None
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    # every request runs its 24 steps (a finished grammar allows only EOS, which ignore_eos
    # passes): the batch has the same shape in both runs at every step
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
              "required": ["color"]}
    regex = r"[a-z]{3}-[0-9]{2}"
    processed = [
        SamplingParams(temperature=1.0, seed=1, max_tokens=24, ignore_eos=True,
                       structured_outputs=S(json=schema, disable_any_whitespace=True)),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                       structured_outputs=S(regex=regex)),
        SamplingParams(temperature=0, max_tokens=24, frequency_penalty=1.5, presence_penalty=0.5,
                       repetition_penalty=1.3, logit_bias={7: 5.0}, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=2, max_tokens=24, allowed_token_ids=list(range(500)),
                       min_tokens=10, ignore_eos=True)]
    free_prompts = [[11 + i, 400 + i, 9000 + i] * 5 for i in range(4)]
    other_prompts = [[21 + i, 500 + i] * 7 for i in range(4)]
    alone = llm.generate(free_prompts + other_prompts, [free] * 8)  # same batch shape, no processing
    mixed = llm.generate(free_prompts + other_prompts, [free] * 4 + processed)
    assert llm.engine.runner.graphs.graphs, "no step was replayed from a graph"
    assert [o.outputs[0].token_ids for o in mixed[:4]] == [o.outputs[0].token_ids
                                                          for o in alone[:4]]
    outs = [o.outputs[0] for o in mixed[4:]]
    jsonschema.validate(json.loads(outs[0].text), schema)
    assert re.fullmatch(regex, outs[1].text), outs[1].text
    assert outs[2].token_ids != alone[6].outputs[0].token_ids
    assert all(t < 500 for t in outs[3].token_ids) and len(outs[3].token_ids) >= 10


def test_greedy_processed_rows_run_ahead_with_the_plain_engines_tokens(tiny_dir,
                                                                       monkeypatch) -> None:
    """Greedy grammar and penalty rows under the overlapped decode (the processing of step t+1
    planned while its forward runs) give the tokens of the engine without overlap."""
    from deltaserve import LLM
    from deltaserve.engine import overlap

    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                             structured_outputs=S(regex=r"[a-z]{3}-[0-9]{2}")),
              SamplingParams(temperature=0, max_tokens=24, frequency_penalty=1.5,
                             presence_penalty=0.5, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)]
    prompts = [[11 + i, 400 + i, 9000 + i] * 5 for i in range(3)]
    finished = []
    finish = overlap.finish
    monkeypatch.setattr(overlap, "finish", lambda e, f: (finished.append(1), finish(e, f)))
    ahead = LLM(tiny_dir, dtype="float32", device="cuda").generate(prompts, params)
    assert len(finished) >= 20
    monkeypatch.setenv("DELTASERVE_OVERLAP", "0")  # each new LLM reads the environment again
    plain_llm = LLM(tiny_dir, dtype="float32", device="cuda")
    assert not plain_llm.engine.config.overlap
    plain = plain_llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in ahead] == [o.outputs[0].token_ids for o in plain]
