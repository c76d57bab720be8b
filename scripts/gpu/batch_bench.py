"""H200: the batched engine at batch 1..128 (aggregate decode tok/s), transformers (with fla when
installed) in the same run, and time to first token behind a cached 4k-token system prompt.

    python3 scripts/gpu/batch_bench.py --out $OUT/batch_bench.json

0.8B-shape synthetic checkpoint in bf16, 16-token random prompts, 64 greedy tokens, EOS ignored;
decode steps replayed from CUDA graphs. With --int8 the same checkpoint quantized to int8 runs
the same batches too (no peer: transformers has no int8 path of this format).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from deltaserve.bench.record import device_info, git_commit  # noqa: E402
from deltaserve.bench.worker import (  # noqa: E402
    _ours_batch,
    _transformers_batch,
    shared_prefix_ttft,
)
from deltaserve.checkpoint.presets import preset  # noqa: E402
from deltaserve.checkpoint.writer import write_checkpoint  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="1,8,32,64,128")
    ap.add_argument("--peer-batches", default="1,8,32", help='"none": no transformers run')
    ap.add_argument("--int8", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp()) / "q08"
    write_checkpoint(preset("qwen3.5-0.8b"), work, seed=0)
    batches = [int(b) for b in args.batches.split(",")]
    record = {"git_commit": git_commit(), "device": device_info("cuda"), "dtype": "bfloat16",
              "fla_installed": importlib.util.find_spec("fla") is not None,
              "workload": {"prompt_len": 16, "decode_tokens": 64, "eos": "ignored"}}
    record["ours"] = _ours_batch(work, "bfloat16", batches, 64, device="cuda")
    print(json.dumps(record["ours"]), flush=True)
    if args.int8:
        from deltaserve.quant.convert import quantize_checkpoint

        quantize_checkpoint(work, "int8", work.parent / "q08-int8")
        record["ours_int8"] = _ours_batch(work.parent / "q08-int8", "bfloat16", batches, 64,
                                          device="cuda")
        print("int8", json.dumps(record["ours_int8"]), flush=True)
    record["shared_prefix"] = shared_prefix_ttft(work, "bfloat16", 4096, device="cuda")
    print(json.dumps(record["shared_prefix"]), flush=True)
    if args.peer_batches != "none":
        peer = [int(b) for b in args.peer_batches.split(",")]
        record["transformers"] = _transformers_batch(work, "bfloat16", peer, 64, device="cuda")
        print(json.dumps(record["transformers"]), flush=True)
    Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
