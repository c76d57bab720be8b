"""Structured outputs in the engine: every output of varied schemas validates (greedy and
sampled, in one batch with free requests), regex and choice match, a constraint waits for the
reasoning block to close, and a schema that cannot compile is refused with its reason."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from deltaserve import SamplingParams
from deltaserve.engine.processors import Processor
from deltaserve.errors import RequestError
from deltaserve.structured.params import StructuredOutputsParams as S
from tests.structured.schemas import SCHEMAS


def test_every_output_validates_greedy_and_sampled_beside_free_requests(default_llm) -> None:
    prompts, params = [], []
    for i, schema in enumerate(SCHEMAS):
        for temperature in (0.0, 1.0):
            prompts.append(f"# record {i}\nrecord = ")
            params.append(SamplingParams(temperature=temperature, seed=i, max_tokens=400,
                                         structured_outputs=S(json=schema)))
    free = SamplingParams(temperature=0, max_tokens=24)
    prompts += ["def main():\n", "import sys\n"]
    params += [free, free]
    outs = default_llm.generate(prompts, params)
    for out, p in zip(outs[:-2], params[:-2], strict=True):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", (p.structured_outputs.json, text)
        jsonschema.validate(json.loads(text), p.structured_outputs.json)
    alone = default_llm.generate(["def main():\n", "import sys\n"], free)
    assert [o.outputs[0].token_ids for o in outs[-2:]] == [o.outputs[0].token_ids for o in alone]


def test_regex_choice_and_grammar_outputs_match(default_llm) -> None:
    regex = r"[A-Z][a-z]{2,5}-[0-9]{3}"
    choices = ("alpha", "beta gamma", 'quote "x"')
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    exact = "a\n3\tb\\x0a \u00e9\x7f1"  # escapes in the choice's grammar literal
    outs = default_llm.generate(["x = ", "y = ", "z = ", "w = ", "v = "], [
        SamplingParams(temperature=1.0, seed=3, max_tokens=40, structured_outputs=S(regex=regex)),
        SamplingParams(temperature=1.0, seed=4, max_tokens=40, structured_outputs=S(choice=choices)),
        SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=S(choice=choices)),
        SamplingParams(temperature=1.0, seed=5, max_tokens=60,
                       structured_outputs=S(grammar=grammar)),
        SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=S(choice=(exact,)))])
    texts = [o.outputs[0].text for o in outs]
    assert re.fullmatch(regex, texts[0]), texts[0]
    assert texts[1] in choices and texts[2] in choices
    assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", texts[3]), texts[3]
    assert texts[4] == exact


def test_json_object_gives_an_object(default_llm) -> None:
    out = default_llm.generate("data = ", SamplingParams(
        temperature=0, max_tokens=120, structured_outputs=S(json_object=True)))[0].outputs[0]
    assert isinstance(json.loads(out.text), dict)


def test_the_constraint_waits_for_the_reasoning_block_to_close(default_llm) -> None:
    engine = default_llm.engine
    params = SamplingParams(structured_outputs=S(choice=("yes", "no")))
    open_id, close_id = 11, 12
    proc = Processor(params, [5, open_id, 7], engine.eos_ids, engine.model.cfg.vocab_size,
                     torch.device("cpu"), engine.tokenizer, engine.grammars, (open_id, close_id))
    assert not proc.constrained  # thinking: free text first
    assert proc.accept(99) and proc.accept(close_id)
    assert proc.constrained
    closed = Processor(params, [open_id, 7, close_id], engine.eos_ids,
                       engine.model.cfg.vocab_size, torch.device("cpu"), engine.tokenizer,
                       engine.grammars, (open_id, close_id))
    assert closed.constrained


@pytest.mark.parametrize("bad, why", [
    (S(regex="(unclosed"), "regex"), (S(grammar="root ::= undefined_rule"), "grammar"),
    (S(json={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}), "json")])
def test_a_constraint_that_cannot_compile_is_refused_with_its_reason(default_llm, bad, why):
    with pytest.raises(RequestError, match=f"the {why} constraint cannot be compiled: .+"):
        default_llm.generate("x", SamplingParams(structured_outputs=bad))


def test_exactly_one_constraint_kind() -> None:
    with pytest.raises(RequestError, match="exactly one"):
        S(regex="a", choice=("b",))
    with pytest.raises(RequestError, match="exactly one"):
        S()


def test_numbers_blanks_and_bounded_strings_are_tightened(default_llm) -> None:
    """As llama.cpp's schema grammars: a model repeating a digit stops at 16, not at its limit;
    blank runs in tool-call parameters stop at 20; a length-bounded string takes no control
    character (xgrammar's would, and JSON parsers refuse them)."""
    import xgrammar as xgr

    from deltaserve.server.tools import ToolSpec, required_tag
    from deltaserve.structured.grammar import (
        _FREE_BLANKS,
        _FREE_DIGITS,
        _FREE_INTEGER,
        _LOOSE_CHAR,
        tightened,
    )

    printed = str(xgr.Grammar.from_json_schema('{"type": "number"}'))
    assert _FREE_INTEGER in printed and _FREE_DIGITS in printed  # what the bound rewrites
    assert _FREE_INTEGER not in tightened(printed)
    short = {"type": "string", "maxLength": 4}
    assert _LOOSE_CHAR in str(xgr.Grammar.from_json_schema(json.dumps(short)))
    spec = ToolSpec({"f": {"type": "object", "properties": {"n": {"type": "integer"}}}})
    assert _FREE_BLANKS in str(xgr.Grammar.from_structural_tag(required_tag(spec)))
    grammars = default_llm.engine.grammars
    call = "<tool_call>\n<function=f>\n<parameter=n>\n"
    for params, good, bad in (
            (S(json=True), "1" * 16, "1" * 17),
            (S(json={"type": "number"}), "-0." + "5" * 16, "-0." + "5" * 17),
            (S(json=short), '"abc"', '"a\x02'),
            (S(structural_tag=required_tag(spec)), call + "7" * 16, call + "7" * 17),
            (S(structural_tag=required_tag(spec)), call + "\n" * 19, call + "\n" * 21)):
        for text, ok in ((good, True), (bad, False)):
            matcher = grammars.matcher(params)
            assert all(matcher.accept_string(c) for c in text) is ok, text
