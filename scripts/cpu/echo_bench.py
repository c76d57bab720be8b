"""Echo scoring, lm-eval's loglikelihood request (echo, logprobs, max_tokens 1), in-process on
one prompt: a forward of its own for the prompt's scores then the generation's prefill (how the
server scored before issue 35) against the prefill scoring the prompt itself
(SamplingParams.prompt_logprobs). Alternating runs; prints one JSON record.

    python scripts/cpu/echo_bench.py MODEL_DIR [--tokens 1700 --rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from deltaserve import LLM, SamplingParams
from deltaserve.bench.record import device_info, git_commit
from deltaserve.server.logprobs import score


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=1700)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    llm = LLM(args.model, dtype="float32", prefix_cache_bytes=0)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 8000, (args.tokens,), generator=gen).tolist()  # in every vocabulary
    plain = SamplingParams(temperature=0, max_tokens=1)
    scored = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    paths = {"two_forwards_s": lambda: (score(llm, ids, 1), llm.generate([ids], plain)),
             "one_forward_s": lambda: llm.generate([ids], scored)}
    runs: dict[str, list[float]] = {name: [] for name in paths}
    for fn in paths.values():
        fn()  # warm-up
    for _ in range(args.rounds):
        for name, fn in paths.items():
            t0 = time.perf_counter()
            fn()
            runs[name].append(time.perf_counter() - t0)
    print(json.dumps({**{k: statistics.median(v) for k, v in runs.items()}, "runs": runs,
                      "model": args.model, "prompt_tokens": len(ids), "dtype": "float32",
                      "commit": git_commit(), "device": device_info("cpu"),
                      "peer": "none: our two paths"}))


if __name__ == "__main__":
    main()
