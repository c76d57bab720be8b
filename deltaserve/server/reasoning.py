"""Reasoning split out of chat output: when the rendered prompt opens a think block (Qwen3.5's
template with thinking on ends with "<think>\\n"), the text up to "</think>" is
`reasoning_content` and the rest `content`, streamed or not, as vLLM's and llama-server's
reasoning parsers return it. With tools, a "<tool_call>" in the think block ends it too (Qwen3.5
may call a tool without closing the block first; vLLM reads it so) and begins the content."""

from __future__ import annotations

OPEN, CLOSE = "<think>\n", "</think>"
TOOL_CALL = "<tool_call>"


def opens_think_block(prompt_text: str) -> bool:
    return prompt_text.endswith(OPEN)


class ReasoningSplitter:
    """push(delta) -> (reasoning delta, content delta); a partial "</think>" at the end of the
    text seen so far is held back until it completes or cannot."""

    def __init__(self, thinking: bool, tools: bool = False) -> None:
        self.in_reasoning, self.held, self.content_started = thinking, "", False
        self.call = TOOL_CALL if tools else None

    def push(self, delta: str) -> tuple[str, str]:
        if not self.in_reasoning:
            return "", self._content(delta)
        text = self.held + delta
        at = text.find(CLOSE)
        call = text.find(self.call) if self.call else -1
        if call >= 0 and (at < 0 or call < at):  # the call is content
            self.in_reasoning, self.held = False, ""
            return text[:call].rstrip("\n"), self._content(text[call:])
        if at >= 0:
            self.in_reasoning, self.held = False, ""
            return text[:at], self._content(text[at + len(CLOSE) :])
        keep = max(partial_tag(text, CLOSE), partial_tag(text, self.call) if self.call else 0)
        self.held = text[len(text) - keep :]
        return text[: len(text) - keep], ""

    def finish(self) -> tuple[str, str]:
        """What is still held back (a think block that never closed stays reasoning)."""
        held, self.held = self.held, ""
        return held, ""

    def _content(self, text: str) -> str:
        if not self.content_started:
            text = text.lstrip("\n")  # the blank line after </think>
            self.content_started = bool(text)
        return text


def partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of text could begin tag (held back from a stream)."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1)
                 if text.endswith(tag[:n])), 0)
