"""Stop conditions: EOS / stop ids, stop strings (with hold-back while streaming), length limits.

Stop strings are matched incrementally, one Knuth-Morris-Pratt automaton per string: its state is
the length of the longest suffix of the text so far that is a prefix of the stop string. A new
character costs amortized O(1) per stop string, however long the output or the stop strings are,
and the text held back while streaming is the largest state (a partial match that may complete).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from deltaserve.engine.sampling import SamplingParams


class _StopMatcher:
    """KMP over one stop string. The failure table grows only as far as the state reaches, so a
    30,000-character stop string that never matches costs nothing up front."""

    __slots__ = ("stop", "fail", "state")

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.fail = [0]  # fail[i]: longest proper border of stop[: i + 1]
        self.state = 0

    def feed(self, text: str) -> int:
        """Advance over text; the index in text just past the first complete match, else -1."""
        stop, fail, state = self.stop, self.fail, self.state
        for i, char in enumerate(text):
            while state and stop[state] != char:
                state = fail[state - 1]
            if stop[state] == char:
                state += 1
                if state == len(stop):
                    self.state = 0  # a match ends generation; any later text starts afresh
                    return i + 1
                if state > len(fail):  # first time this deep: one more table entry
                    self._extend()
        self.state = state
        return -1

    def _extend(self) -> None:
        stop, fail = self.stop, self.fail
        char = stop[len(fail)]
        border = fail[-1]
        while border and stop[border] != char:
            border = fail[border - 1]
        fail.append(border + 1 if stop[border] == char else border)


@dataclass(slots=True)
class StopChecker:
    params: SamplingParams
    eos_ids: frozenset[int]
    emitted: int = 0  # characters already handed to the caller
    # text not yet handed out (a possible stop string's start), as the deltas it came in: joined
    # only when released, so a long partial match is not copied again on every token
    _pending: deque[str] = field(default_factory=deque, init=False)
    _pending_len: int = field(default=0, init=False)
    _matchers: list[_StopMatcher] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self._matchers = [_StopMatcher(stop) for stop in self.params.stop]

    def token_stop(self, token_id: int) -> tuple[str, int | None] | None:
        """(finish_reason, stop_reason) if this token ends generation, else None."""
        if token_id in self.params.stop_token_ids:
            return "stop", token_id
        if not self.params.ignore_eos and token_id in self.eos_ids:
            return "stop", None
        return None

    def add_text(self, delta: str, match: bool = True) -> tuple[str, str | None]:
        """Append decoded text; returns (text safe to emit now, matched stop string or None).
        match=False (before min_tokens): the text goes out unmatched."""
        if not self._matchers or (not match and not self._pending):  # straight out
            self.emitted += len(delta)
            return delta, None
        ends = [matcher.feed(delta) for matcher in self._matchers]
        self._pending.append(delta)
        self._pending_len += len(delta)
        # vLLM's rule: the first stop string in params.stop order that occurs wins, cut at its
        # first occurrence (even if a later-listed one ends earlier in this delta)
        for stop, end in zip(self.params.stop, ends, strict=True):
            if end >= 0:
                cut = self._pending_len - len(delta) + end
                if not self.params.include_stop_str_in_output:
                    cut -= len(stop)
                for matcher in self._matchers:
                    matcher.state = 0
                out = self._release(self._pending_len - cut)
                self._pending.clear()
                self._pending_len = 0
                return out, stop
        return self._release(max(matcher.state for matcher in self._matchers)), None

    def finish(self) -> str:
        return self._release(0)

    def _release(self, num_held: int) -> str:
        """Hand out the pending text except its last num_held characters."""
        num_out = self._pending_len - num_held
        out = []
        while num_out > 0:
            chunk = self._pending[0]
            if len(chunk) <= num_out:
                out.append(self._pending.popleft())
            else:  # split: only this delta's remainder is copied
                out.append(chunk[:num_out])
                self._pending[0] = chunk[num_out:]
            num_out -= len(out[-1])
        text = "".join(out)
        self._pending_len -= len(text)
        self.emitted += len(text)
        return text
