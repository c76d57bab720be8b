"""Decode time with many long stop strings that never match (issue 31, item 6).

python scripts/cpu/stop_strings_bench.py [--tokens 1200] [--stops 16] [--stop-chars 30000]
Runs the embedded default model greedily (ignore_eos) without and with the stop strings.
"""

from __future__ import annotations

import argparse
import time

from deltaserve import LLM, SamplingParams


def timed(llm: LLM, params: SamplingParams, prompt: str) -> tuple[float, int]:
    t0 = time.perf_counter()
    out = llm.generate([prompt], params)[0]
    return time.perf_counter() - t0, len(out.outputs[0].token_ids)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=1200)
    parser.add_argument("--stops", type=int, default=16)
    parser.add_argument("--stop-chars", type=int, default=30_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    llm = LLM()
    # distinct strings the output never contains (a control character the model cannot emit)
    stops = tuple(f"\x01{i:02d}" + "x" * (args.stop_chars - 3) for i in range(args.stops))
    prompt = "Once upon a time"
    plain = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    with_stops = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True, stop=stops)
    timed(llm, plain, prompt)  # warm-up
    for name, params in (("no stops", plain), (f"{args.stops} x {args.stop_chars}", with_stops)):
        runs = [timed(llm, params, prompt) for _ in range(args.repeats)]
        best = min(t for t, _ in runs)
        print(f"{name:>16}: {runs[0][1]} tokens, best of {args.repeats} {best:.3f} s "
              f"({runs[0][1] / best:.0f} tok/s)")


if __name__ == "__main__":
    main()
