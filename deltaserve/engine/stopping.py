"""Stop conditions: EOS / stop ids, stop strings (with hold-back while streaming), length limits."""

from __future__ import annotations

from dataclasses import dataclass

from deltaserve.engine.sampling import SamplingParams


@dataclass(slots=True)
class StopChecker:
    params: SamplingParams
    eos_ids: frozenset[int]
    text: str = ""
    emitted: int = 0  # characters of `text` already handed to the caller

    def token_stop(self, token_id: int) -> tuple[str, int | None] | None:
        """(finish_reason, stop_reason) if this token ends generation, else None."""
        if token_id in self.params.stop_token_ids:
            return "stop", token_id
        if not self.params.ignore_eos and token_id in self.eos_ids:
            return "stop", None
        return None

    def add_text(self, delta: str) -> tuple[str, str | None]:
        """Append decoded text; returns (text safe to emit now, matched stop string or None)."""
        if not self.params.stop:  # nothing to match or hold back: the delta goes straight out
            self.emitted += len(delta)
            return delta, None
        start = max(0, len(self.text) - max((len(s) for s in self.params.stop), default=0))
        self.text += delta
        for stop in self.params.stop:
            at = self.text.find(stop, start)
            if at >= 0:
                end = at + len(stop) if self.params.include_stop_str_in_output else at
                self.text = self.text[:end]
                return self._take(len(self.text)), stop
        return self._take(len(self.text) - self._held_back()), None

    def finish(self) -> str:
        return self._take(len(self.text)) if self.params.stop else ""

    def _held_back(self) -> int:
        """Length of the longest suffix of `text` that could still grow into a stop string."""
        best = 0
        for stop in self.params.stop:
            for n in range(min(len(stop) - 1, len(self.text)), best, -1):
                if self.text.endswith(stop[:n]):
                    best = n
                    break
        return best

    def _take(self, upto: int) -> str:
        upto = max(upto, self.emitted)
        out = self.text[self.emitted : upto]
        self.emitted = upto
        return out
