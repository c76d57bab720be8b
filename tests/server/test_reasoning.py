"""The reasoning split, whole and streamed in every cut of the text."""

from __future__ import annotations

import pytest

from deltaserve.server.reasoning import ReasoningSplitter, opens_think_block, split

TEXT = "Let me think.\nIt is 4.\n</think>\n\nThe answer is 4."


def test_whole_text_split() -> None:
    assert split(TEXT, True) == ("Let me think.\nIt is 4.", "The answer is 4.")
    assert split(TEXT, False) == (None, TEXT)
    assert split("never closes </thi", True) == ("never closes </thi", "")
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
