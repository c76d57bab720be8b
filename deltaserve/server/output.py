"""One choice's output, whatever its delivery: every engine event of a choice goes through push(),
which splits reasoning from content, tool calls from the content (server/tools.py, when the
request has tools) and builds the logprobs object with running text offsets;
a stream sends each Delta, a whole response joins them (whole()). The engine has detokenized and
checked stops already (engine.emit); this is the one place the server turns events into API text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deltaserve.server.logprobs import step_logprobs
from deltaserve.server.reasoning import ReasoningSplitter
from deltaserve.server.tools import ToolCalls, ToolSpec


@dataclass(slots=True)
class Delta:
    """What one event adds to a choice."""

    reasoning: str
    text: str
    logprobs: dict | None
    finish_reason: str | None  # set on the choice's last event
    tool_calls: list[dict] = field(default_factory=list)  # calls completed by this event
    stop_reason: str | int | None = None  # vLLM's: the stop string or token id that ended it


@dataclass(slots=True)
class Whole:
    reasoning: str | None  # None unless the prompt opened a think block (chat)
    text: str
    logprobs: dict | None
    finish_reason: str
    token_ids: list[int] = field(default_factory=list)
    tool_calls: list[dict] = field(default_factory=list)
    stop_reason: str | int | None = None


class ChoiceOutput:
    """kind: "chat.completion" or "text_completion"; thinking: the rendered prompt opened a think
    block (reasoning until "</think>"); decode: the tokenizer's decode, top_k the alternatives per
    token and want_logprobs whether the request asked for them; offset: where generated text
    starts in the returned text (after an echoed prompt); tools: the request's tools, whose
    calls are parsed out of the content (None: the content is text only)."""

    def __init__(self, kind: str, thinking: bool, decode, top_k: int, want_logprobs: bool,
                 offset: int = 0, tools: ToolSpec | None = None) -> None:
        self.kind, self.decode, self.top_k = kind, decode, top_k
        self.want_logprobs, self.offset = want_logprobs, offset
        self.thinking = thinking and kind == "chat.completion"
        self._splitter = ReasoningSplitter(self.thinking, tools is not None)
        self._reasoning: list[str] = []
        self._text: list[str] = []
        self._logprobs: list[dict] = []
        self.token_ids: list[int] = []
        self.prompt_logprobs = None  # the engine's, on the first event when it scored the prompt
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self._tools = ToolCalls(tools) if tools is not None else None

    def push(self, ev) -> Delta:
        """One engine StepOutput of this choice."""
        self.token_ids.extend(ev.token_ids)
        if ev.prompt_logprobs is not None:
            self.prompt_logprobs = ev.prompt_logprobs
        reasoning, text = self._splitter.push(ev.text)
        finish, calls = None, []
        if ev.finished:
            reasoning += self._splitter.finish()[0]
        if self._tools is not None:
            text, calls = self._tools.push(text, final=ev.finished)
        if ev.finished:
            finish = ev.finish_reason or "stop"
            if finish == "stop" and self._tools is not None and self._tools.calls:
                finish = "tool_calls"
            self.finish_reason = finish
            self.stop_reason = ev.stop_reason if finish in ("stop", "tool_calls") else None
        lps = None
        if self.want_logprobs and ev.logprobs:
            lps, self.offset = step_logprobs(self.kind, self.decode, ev.token_ids,
                                             ev.logprobs, self.top_k, self.offset)
            self._logprobs.append(lps)
        self._reasoning.append(reasoning)
        self._text.append(text)
        return Delta(reasoning, text, lps, finish, calls, self.stop_reason)

    def whole(self) -> Whole:
        """Every delta joined: the non-streamed choice (reasoning without its trailing blank
        line, as the whole think block reads)."""
        reasoning = "".join(self._reasoning).rstrip("\n") if self.thinking else None
        calls = self._tools.calls if self._tools is not None else []
        return Whole(reasoning, "".join(self._text), self._joined_logprobs(),
                     self.finish_reason or "stop", self.token_ids, calls, self.stop_reason)

    def _joined_logprobs(self) -> dict | None:
        if not self.want_logprobs:
            return None
        if self.kind == "chat.completion":
            return {"content": [item for part in self._logprobs for item in part["content"]]}
        out = {"tokens": [], "token_logprobs": [], "text_offset": [],
               "top_logprobs": [] if self.top_k > 0 else None}
        for part in self._logprobs:
            for key in ("tokens", "token_logprobs", "text_offset"):
                out[key] += part[key]
            if self.top_k > 0:
                out["top_logprobs"] += part["top_logprobs"]
        return out
