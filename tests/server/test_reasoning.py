"""The reasoning split through a choice's output processor (server/output.py), whole and streamed
in every cut of the text; and the logprobs a whole response joins from the streamed parts."""

from __future__ import annotations

import pytest

from deltaserve.engine.engine import StepOutput
from deltaserve.server.output import ChoiceOutput
from deltaserve.server.reasoning import ReasoningSplitter, opens_think_block

TEXT = "Let me think.\nIt is 4.\n</think>\n\nThe answer is 4."


def events(text: str, step: int, with_lps: bool = False) -> list:
    """text in pieces of `step` characters as engine events, one token id per piece."""
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    return [StepOutput("r", p, (i,), finished=i == len(pieces) - 1,
                       finish_reason="stop" if i == len(pieces) - 1 else None,
                       logprobs=((-0.5 * i, ((i, -0.5 * i),)),) if with_lps else None)
            for i, p in enumerate(pieces)]


def whole(text: str, thinking: bool, kind: str = "chat.completion"):
    out = ChoiceOutput(kind, thinking, None, 0, False)
    for ev in events(text, len(text)):
        out.push(ev)
    return out.whole()


def test_whole_text_split() -> None:
    w = whole(TEXT, True)
    assert (w.reasoning, w.text, w.finish_reason) == ("Let me think.\nIt is 4.", "The answer is 4.",
                                                      "stop")
    assert (whole(TEXT, False).reasoning, whole(TEXT, False).text) == (None, TEXT)
    assert whole(TEXT, True, "text_completion").text == TEXT  # completions never split
    never = whole("never closes </thi", True)
    assert (never.reasoning, never.text) == ("never closes </thi", "")
    assert opens_think_block("<|im_start|>assistant\n<think>\n")
    assert not opens_think_block("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("step", [1, 2, 3, 5, 7])
def test_streamed_pieces_add_up_to_the_whole_split(step) -> None:
    splitter = ReasoningSplitter(True)
    reasoning, content = "", ""
    for i in range(0, len(TEXT), step):
        r, c = splitter.push(TEXT[i : i + step])
        reasoning, content = reasoning + r, content + c
    tail, _ = splitter.finish()
    assert (reasoning + tail).rstrip("\n") == "Let me think.\nIt is 4."
    assert content == "The answer is 4."
    assert "</" not in reasoning + content.replace("The answer is 4.", "")
    out = ChoiceOutput("chat.completion", True, None, 0, False)
    deltas = [out.push(ev) for ev in events(TEXT, step)]
    assert "".join(d.text for d in deltas) == content == out.whole().text
    assert [d.finish_reason for d in deltas][-1] == "stop"


@pytest.mark.parametrize("kind", ["text_completion", "chat.completion"])
def test_whole_logprobs_are_the_streamed_parts_joined(kind) -> None:
    """Offsets run on across events from where the generated text starts (after an echo)."""
    decode = lambda ids: f"<{ids[0]}>"  # noqa: E731
    out = ChoiceOutput(kind, False, decode, 1, True, offset=10)
    parts = [out.push(ev).logprobs for ev in events("abcdef", 2, with_lps=True)]
    got = out.whole().logprobs
    if kind == "chat.completion":
        assert got["content"] == [item for p in parts for item in p["content"]]
        assert [c["token"] for c in got["content"]] == ["<0>", "<1>", "<2>"]
    else:
        assert got["tokens"] == ["<0>", "<1>", "<2>"]
        assert got["text_offset"] == [10, 13, 16]
        assert got["token_logprobs"] == [0.0, -0.5, -1.0]
        assert got["top_logprobs"] == [{"<0>": 0.0}, {"<1>": -0.5}, {"<2>": -1.0}]
