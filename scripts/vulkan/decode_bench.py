"""Decode speed of `--device vulkan` at batch 1 (and a small batch), with the greedy tokens
checked against the CPU fp32 path on the same checkpoint; writes a JSON record.

    python scripts/vulkan/decode_bench.py --model DIR --tokens 64 --out F.json [--check-cpu 8]
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from deltaserve import LLM  # noqa: E402
from deltaserve.engine.sampling import SamplingParams  # noqa: E402

PROMPT = "The history of the city begins with"


def timed(llm, prompts, tokens):
    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2))  # pipelines, pools
    t = time.perf_counter()
    out = llm.generate(prompts, sp)
    dt = time.perf_counter() - t
    return [list(o.outputs[0].token_ids) for o in out], dt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--check-cpu", type=int, default=8, help="greedy tokens compared (0: off)")
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens timed (0: off)")
    ap.add_argument("--memory-limit", type=float, default=None, help="--gpu-memory-limit GB")
    ap.add_argument("--dtype", default="float32", help="float32 or float16 (dense weights)")
    ap.add_argument("--greedy-head", action="store_true", help="tokens from the GPU's argmax")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    vk = LLM(args.model, device="vulkan", gpu_memory_limit_gb=args.memory_limit,
             greedy_head=args.greedy_head, dtype=args.dtype)
    dev = vk.model.vulkan.dev
    rec = {"kind": "vulkan-decode", "git_commit": os.environ.get("DELTASERVE_GIT_COMMIT", ""),
           "device": dev.name, "model": args.model, "dtype": args.dtype,
           "gemv_lanes": dev.gemv_lanes, "tokens": args.tokens,
           "weights_gib": vk.model.vulkan.weights_bytes / 2**30,
           "gpu_memory_limit_gb": args.memory_limit, "greedy_head": args.greedy_head}
    ids, dt = timed(vk, [PROMPT], args.tokens)
    rec["b1_tok_s"] = args.tokens / dt  # prefill of the short prompt included
    _, dt = timed(vk, [PROMPT + f" {i}" for i in range(args.batch)], args.tokens)
    rec[f"b{args.batch}_tok_s"] = args.batch * args.tokens / dt
    if args.prefill:
        ids_in = vk.tokenizer.encode(" ".join(["tok"] * 4 * args.prefill))[:args.prefill]
        sp = SamplingParams(temperature=0, max_tokens=1)
        t = time.perf_counter()
        vk.generate([{"prompt_token_ids": ids_in}], sp)
        rec[f"prefill{args.prefill}_tok_s"] = args.prefill / (time.perf_counter() - t)
    rec["allocated_gib"] = dev.allocated / 2**30  # weights, pools, step scratch
    if args.check_cpu:
        cpu, _ = timed(LLM(args.model, dtype="float32"), [PROMPT], args.check_cpu)
        rec["greedy_equal_cpu_fp32"] = cpu[0] == ids[0][:args.check_cpu]
    print(json.dumps(rec))
    Path(args.out).write_text(json.dumps(rec))


if __name__ == "__main__":
    main()
