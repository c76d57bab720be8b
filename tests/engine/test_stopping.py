"""Stop strings: the incremental matcher equals a brute-force search of the whole text after every
delta, and its work per output character does not grow with the output (issue 31, item 6)."""

from __future__ import annotations

import random

import pytest

from deltaserve.engine.sampling import SamplingParams
from deltaserve.engine.stopping import StopChecker


def brute_force(
    stops: tuple[str, ...], include: bool, deltas: list[str]
) -> tuple[list[str], str | None]:
    """The spec: after each delta search the whole text for every stop string (list order, first
    occurrence); hold back the longest suffix that is a proper prefix of some stop string."""
    text, emitted, out = "", 0, []
    for delta in deltas:
        text += delta
        for stop in stops:
            at = text.find(stop)
            if at >= 0:
                end = at + len(stop) if include else at
                assert end >= emitted  # nothing handed out is ever taken back
                out.append(text[emitted:end])
                return out, stop
        held = max(n for stop in stops for n in range(len(stop)) if text.endswith(stop[:n]))
        out.append(text[emitted : len(text) - held])
        emitted = len(text) - held
    out.append(text[emitted:])  # finish(): the held-back tail once generation ends otherwise
    return out, None


def run_checker(
    stops: tuple[str, ...], include: bool, deltas: list[str]
) -> tuple[list[str], str | None]:
    checker = StopChecker(
        SamplingParams(stop=stops, include_stop_str_in_output=include), frozenset()
    )
    out = []
    for delta in deltas:
        text, stop = checker.add_text(delta)
        out.append(text)
        if stop is not None:
            return out, stop
    out.append(checker.finish())
    return out, None


def random_split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.randint(0, len(text)) for _ in range(rng.randint(0, len(text))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize("alphabet", ["ab", "abc", "aé"])
def test_matches_a_brute_force_search_after_every_delta(alphabet: str) -> None:
    rng = random.Random(alphabet)
    word = lambda n: "".join(rng.choice(alphabet) for _ in range(n))  # noqa: E731
    for _ in range(3000):
        stops = tuple(word(rng.randint(1, 6)) for _ in range(rng.randint(1, 3)))
        text = word(rng.randint(0, 30))
        if rng.random() < 0.5:  # plant a stop string (often several overlap anyway)
            at = rng.randint(0, len(text))
            text = text[:at] + rng.choice(stops) + text[at:]
        deltas = random_split(text, rng)  # empty deltas included
        include = rng.random() < 0.5
        case = (stops, include, deltas)
        assert run_checker(*case) == brute_force(*case), case


def test_first_listed_stop_wins_even_when_a_later_one_ends_first() -> None:
    """vLLM's order: params.stop order first, then the earliest occurrence of that stop."""
    checker = StopChecker(SamplingParams(stop=("cd", "b")), frozenset())
    assert checker.add_text("abcde") == ("ab", "cd")  # "b" ended first but is listed second
    held = StopChecker(
        SamplingParams(stop=("xy", "y"), include_stop_str_in_output=True), frozenset()
    )
    assert held.add_text("ax") == ("a", None)  # "x" may start "xy"
    assert held.add_text("yz") == ("xy", "xy")


class CountingStr(str):
    """A stop string that counts how often the matcher reads it (index or slice)."""

    reads = 0

    def __getitem__(self, key):
        CountingStr.reads += 1
        return str.__getitem__(self, key)


@pytest.mark.parametrize("kind", ["never-matches", "long-partial-match"])
def test_work_per_output_character_is_bounded(kind: str) -> None:
    """Reads of the stop strings per output character stay bounded, however long the output
    grows (the old hold-back re-sliced every stop prefix up to the text's length per token)."""
    if kind == "never-matches":  # the issue's bench: long stop strings the output never holds
        stops = tuple(CountingStr(f"\x01{i}" + "x" * 3000) for i in range(4))
        delta = "once"
    else:  # the output keeps extending a partial match of a long stop string, then breaks it
        stops = (CountingStr("ab" * 1500 + "c"),)
        delta = "abab"
    checker = StopChecker(SamplingParams(stop=stops), frozenset())
    out = []
    CountingStr.reads = 0
    for _ in range(600):
        text, stop = checker.add_text(delta)
        assert stop is None
        out.append(text)
    out.append(checker.add_text("d")[0])
    assert "".join(out) == delta * 600 + "d"
    num_chars = 600 * len(delta) + 1
    # KMP: under 2 comparisons per character per stop, amortized, and as many again to build
    # the failure table (each comparison 1 or 2 reads); the old code made ~300 per character
    # per stop here (2.9 million), growing with the output
    assert CountingStr.reads <= 8 * num_chars * len(stops), CountingStr.reads


def test_issue_scale_stop_strings_stream_everything() -> None:
    """Sixteen 30,000-character stop strings, 1,200 deltas: every character goes out on time
    (nothing held back: no suffix of the output starts a stop string)."""
    stops = tuple(f"\x01{i:02d}" + "x" * 29_997 for i in range(16))
    checker = StopChecker(SamplingParams(stop=stops), frozenset())
    deltas = [f"t{i % 100:02d} " for i in range(1200)]
    assert [checker.add_text(d) for d in deltas] == [(d, None) for d in deltas]
    assert checker.finish() == ""
