"""The LLM API on the tiny checkpoint: outputs, stop conditions, streaming, chat, limits."""

from __future__ import annotations

import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.errors import RequestError
from deltaserve.tokenizer import StreamDecoder

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_generate_shapes_like_vllm(tiny_llm) -> None:
    outs = tiny_llm.generate(["def f(x):", "Hello"], GREEDY)
    assert len(outs) == 2
    for out in outs:
        assert len(out.outputs[0].token_ids) == 12
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].text == tiny_llm.tokenizer.decode(out.outputs[0].token_ids, True)
    assert outs[0].prompt_token_ids == tiny_llm.tokenizer.encode("def f(x):")


def test_token_id_prompt_equals_text_prompt(tiny_llm) -> None:
    ids = tiny_llm.tokenizer.encode("Hello world")
    a = tiny_llm.generate("Hello world", GREEDY)[0].outputs[0].token_ids
    b = tiny_llm.generate({"prompt_token_ids": ids}, GREEDY)[0].outputs[0].token_ids
    assert a == b


def test_stream_concatenates_to_generate(tiny_llm) -> None:
    events = list(tiny_llm.stream("Once upon a time", GREEDY))
    full = tiny_llm.generate("Once upon a time", GREEDY)[0].outputs[0]
    assert "".join(e.text for e in events) == full.text
    assert [t for e in events for t in e.token_ids] == full.token_ids
    assert events[-1].finished and events[-1].finish_reason == "length"
    assert not any(e.finished for e in events[:-1])


def test_stop_token_id_and_stop_string(tiny_llm) -> None:
    base = tiny_llm.generate("abc", GREEDY)[0].outputs[0]
    stop_id = base.token_ids[3]
    first = base.token_ids.index(stop_id)
    out = tiny_llm.generate(
        "abc", SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id])
    )[0]
    assert out.outputs[0].token_ids == base.token_ids[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_id
    needle = base.text[len(base.text) // 2 :][:3]
    if needle.strip():
        cut = tiny_llm.generate("abc", SamplingParams(temperature=0, max_tokens=12, stop=[needle]))[
            0
        ].outputs[0]
        assert cut.text == base.text[: base.text.index(needle)]
        assert cut.stop_reason == needle


def test_seeded_sampling_is_reproducible(tiny_llm) -> None:
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=42, max_tokens=10, ignore_eos=True)
    a = tiny_llm.generate("x", params)[0].outputs[0].token_ids
    b = tiny_llm.generate("x", params)[0].outputs[0].token_ids
    assert a == b


def test_context_limit_and_empty_prompt(tiny_dir) -> None:
    llm = LLM(tiny_dir, dtype="float32", max_model_len=10)
    with pytest.raises(RequestError, match="context limit is 10"):
        llm.generate("one two three four five six seven eight nine ten eleven", GREEDY)
    with pytest.raises(RequestError, match="empty"):
        llm.generate("", GREEDY)
    out = llm.generate("one two", SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 10  # stops at the limit
    assert out.outputs[0].finish_reason == "length"


def test_eos_from_generation_config(tiny_llm) -> None:
    assert {248044, 248046} <= tiny_llm.eos_token_ids


def test_chat_applies_the_template(tiny_llm) -> None:
    prompt = tiny_llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], enable_thinking=False
    )
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    out = tiny_llm.chat([{"role": "user", "content": "hi"}], GREEDY, enable_thinking=False)
    assert out.prompt_token_ids[:1] == [tiny_llm.tokenizer.token_id("<|im_start|>")]


def test_stream_decoder_never_splits_utf8(tiny_llm) -> None:
    tok = tiny_llm.tokenizer
    text = "naïve 你好世界 🙂🚀 ऋषि ok"
    ids = tok.encode(text)
    # force byte-level pieces: emoji and CJK often span several byte tokens
    byte_ids = [i for ch in text for i in tok.encode(ch)]
    for seq in (ids, byte_ids):
        dec = StreamDecoder(tok)
        pieces = [dec.push(i) for i in seq] + [dec.flush()]
        assert "".join(pieces) == text
        assert all("\ufffd" not in p for p in pieces)


def test_default_batched_tokens_fall_back_where_8192_would_cut_the_kv_cache() -> None:
    """LLM(max_num_batched_tokens=None): 8192 on CUDA while its scratch leaves the KV blocks 2048
    leaves; 2048 where it would cut them or not fit at all (8192 under TP/PP, where one rank's
    memory must not decide); 2048 on CPU. The chosen budget's plan comes back with it."""
    import torch

    from deltaserve.engine.llm import _default_batched_tokens
    from deltaserve.errors import CapacityError

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert _default_batched_tokens(cuda, lambda t: (100, None)) == (8192, (100, None))
    shorter = lambda t: (100 if t == 2048 else 90, None)  # noqa: E731
    assert _default_batched_tokens(cuda, shorter) == (2048, (100, None))
    assert _default_batched_tokens(cuda, shorter, ranks_agree=False)[0] == 8192  # TP, PP

    def refuses_8192(t: int):
        if t == 8192:
            raise CapacityError("too big")
        return 100, None

    assert _default_batched_tokens(cuda, refuses_8192)[0] == 2048
    assert _default_batched_tokens(cpu, refuses_8192)[0] == 2048
