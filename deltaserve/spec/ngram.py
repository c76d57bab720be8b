"""Prompt-lookup (n-gram) drafting: find the context's latest earlier occurrence of its own last n
tokens (n from prompt_lookup_max down to prompt_lookup_min) and propose the tokens that followed.
"""

from __future__ import annotations

import numpy as np


def propose_ngram(token_ids: list[int], num_drafts: int, min_n: int, max_n: int) -> list[int]:
    """Up to num_drafts tokens that followed the most recent earlier match of the longest suffix
    of token_ids (length in [min_n, max_n]); [] when no suffix recurs."""
    num_tokens = len(token_ids)
    if num_drafts < 1 or num_tokens <= min_n:
        return []
    # int32 bytes: bytes.rfind is a C search; a hit must also sit on a token boundary
    data = np.asarray(token_ids, dtype=np.int32).tobytes()
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        pattern = data[4 * (num_tokens - n):]
        end = 4 * (num_tokens - 1)  # the match must end before the last token (not itself)
        while True:
            at = data.rfind(pattern, 0, end)
            if at < 0:
                break
            if at % 4 == 0:
                start = at // 4 + n
                return list(token_ids[start : start + num_drafts])
            end = at + len(pattern) - 1
    return []


class AdaptiveGate:
    """Per-request off-switch: drafting stops for good once min_drafts tokens were drafted and
    fewer than min_acceptance of them were accepted."""

    __slots__ = ("min_drafts", "min_acceptance", "num_drafted", "num_accepted", "enabled")

    def __init__(self, min_drafts: int, min_acceptance: float) -> None:
        self.min_drafts, self.min_acceptance = min_drafts, min_acceptance
        self.num_drafted = self.num_accepted = 0
        self.enabled = True

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        if (self.num_drafted >= self.min_drafts
                and self.num_accepted < self.min_acceptance * self.num_drafted):
            self.enabled = False
