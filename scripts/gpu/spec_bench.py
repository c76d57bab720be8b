"""H200: speculative decoding (issue 9) with and without drafts, through bench/spec.py.

    python3 scripts/gpu/spec_bench.py --out $OUT/spec-bench.json    # (session.sh spec)

1. the embedded default model (stdlib-19m, trained: its acceptance rates mean something) on
   prose, code and the repetitive ceiling, n-gram and MTP, batch 1 and all prompts at once;
2. the 0.8B shape with random weights (bf16): what a verify step costs against a CUDA-graph decode
   step at a real model's size (acceptance there says nothing about real text).
The baseline is the default engine (CUDA graphs, overlapped greedy steps); speculative runs step
unoverlapped and verify eagerly. tokens_identical is reported, not assumed: on CUDA cuBLAS picks
kernels by row count, so verify rows and single decodes may round differently (spec/rollback.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from deltaserve.bench.record import device_info, git_commit  # noqa: E402
from deltaserve.bench.spec import run  # noqa: E402
from deltaserve.checkpoint.presets import preset  # noqa: E402
from deltaserve.checkpoint.writer import write_checkpoint  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--methods", default="ngram,mtp")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-q08", action="store_true", help="the default model only")
    args = ap.parse_args()
    methods, batches = args.methods.split(","), [int(b) for b in args.batches.split(",")]
    from deltaserve import LLM

    k = args.num_speculative_tokens
    record = {"git_commit": git_commit(), "device": device_info("cuda"), "dtype": "bfloat16",
              "num_speculative_tokens": k, "eos": "ignored",
              "note": "repetitive = the ceiling, not the headline"}
    t0 = time.perf_counter()
    llm = LLM(None, dtype="bfloat16", device="cuda")
    record["default_model"] = run(llm, methods, k, args.max_tokens, batches, args.repeats)
    del llm
    print(f"default model done in {time.perf_counter() - t0:.0f} s", flush=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")  # kept if the rest times out
    if args.skip_q08:
        return
    work = Path(tempfile.mkdtemp()) / "q08"
    write_checkpoint(preset("qwen3.5-0.8b"), work, seed=0)
    llm = LLM(work, dtype="bfloat16", device="cuda")
    record["q08_random"] = run(llm, methods, k, 64, [1], args.repeats)
    print(f"all done in {time.perf_counter() - t0:.0f} s", flush=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
