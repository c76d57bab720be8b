"""Speed of `--device vulkan`: decode at each batch size (the prompts' prefill taken out), prefill
at each prompt length, and where asked the GPU time per component; the greedy tokens checked
against the CPU fp32 path on the same checkpoint. Writes a JSON record.

    python scripts/vulkan/decode_bench.py --model DIR --tokens 64 --batches 1,32,128 \
        --prefill 512,2048 --profile --check-cpu 8 --out F.json

Decode rate at batch B: B * (N - 1) / (t(N tokens) - t(1 token)), each call on fresh prompts (the
prefix cache is off); prefill rate: P / the time to the first token of a P-token prompt, the best
of two. --profile: one b1 decode of 8 tokens and one prefill of the first length again with every
dispatch timed on the GPU (vulkan/device.Profiler), in ms per step by `section:kernel`.
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


def run(llm, prompts, tokens):
    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    t = time.perf_counter()
    out = llm.generate(prompts, sp)
    return [list(o.outputs[0].token_ids) for o in out], time.perf_counter() - t


def decode_rate(llm, batch: int, tokens: int, tag: int) -> float:
    prompts = [f"{PROMPT} {tag} {i}" for i in range(batch)]
    run(llm, prompts, 2)  # pipelines, pools, scratch at this width
    _, t1 = run(llm, [p + " a" for p in prompts], 1)
    _, tn = run(llm, [p + " b" for p in prompts], tokens)
    return batch * (tokens - 1) / max(tn - t1, 1e-9)


def prefill_rate(llm, length: int) -> float:
    ids = llm.tokenizer.encode(" ".join(["tok"] * 4 * length))[:length]
    best = 0.0
    for i in range(2):
        sp = SamplingParams(temperature=0, max_tokens=1)
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": [i + 1] + ids[1:]}], sp)
        best = max(best, length / (time.perf_counter() - t))
    return best


def profile(llm, lengths: list[int]) -> dict:
    """Per step: decode b1 as (a 9-token run - a 1-token run) / 8 on prompts of one length (the
    prompt's prefill step taken out); prefill of the first length as one run."""
    dev = llm.model.vulkan.dev
    if "timestamp-query" not in dev.features:
        return {"error": f"{dev.name} has no timestamp queries"}

    def timed(prompt, tokens):
        dev.profile(True)
        t = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
        wall = time.perf_counter() - t
        return wall, dev.profile(False)

    w1, r1 = timed(f"{PROMPT} profiled a", 1)
    w9, r9 = timed(f"{PROMPT} profiled b", 9)
    diff = {k: {f: r9[k][f] - r1.get(k, {}).get(f, 0) for f in r9[k] if f != "steps"}
            for k in r9}
    out = {"decode_b1": {"wall_ms_per_step": 1e3 * (w9 - w1) / 8, **per_step(diff, 8)}}
    if lengths:
        ids = llm.tokenizer.encode(" ".join(["tok"] * 4 * lengths[0]))[:lengths[0]]
        wall, rep = timed({"prompt_token_ids": [7] + ids[1:]}, 1)
        out[f"prefill_{lengths[0]}"] = {"wall_ms": 1e3 * wall, **per_step(rep, 1)}
    return out


def per_step(rep: dict, steps: int) -> dict:
    tot = rep["_"]
    return {"gpu_ms": tot["ms"] / steps, "dispatches": tot["dispatches"] / steps,
            "host_encode_ms": tot["encode_ms"] / steps, "host_wait_ms": tot["wait_ms"] / steps,
            "components_ms": {k: round(v["ms"] / steps, 4) for k, v in
                              sorted(rep.items(), key=lambda kv: -kv[1]["ms"]) if k != "_"}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,4", help="decode batch sizes, comma-separated")
    ap.add_argument("--check-cpu", type=int, default=8, help="greedy tokens compared (0: off)")
    ap.add_argument("--prefill", default="512", help="prompt lengths timed ('' : none)")
    ap.add_argument("--memory-limit", type=float, default=None, help="--gpu-memory-limit GB")
    ap.add_argument("--dtype", default="float32", help="float32 or float16 (dense weights)")
    ap.add_argument("--greedy-head", action="store_true", help="tokens from the GPU's argmax")
    ap.add_argument("--profile", action="store_true", help="GPU time per component")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",") if b]
    lengths = [int(p) for p in args.prefill.split(",") if p]
    vk = LLM(args.model, device="vulkan", gpu_memory_limit_gb=args.memory_limit,
             greedy_head=args.greedy_head, dtype=args.dtype, prefix_cache_bytes=0,
             max_num_seqs=max(batches + [1]), max_num_batched_tokens=max(lengths + [2048]))
    dev = vk.model.vulkan.dev
    rec = {"kind": "vulkan-decode", "git_commit": os.environ.get("DELTASERVE_GIT_COMMIT", ""),
           "device": dev.name, "model": args.model, "dtype": args.dtype,
           "gemv_lanes": dev.gemv_lanes, "tokens": args.tokens,
           "weights_gib": vk.model.vulkan.weights_bytes / 2**30,
           "gpu_memory_limit_gb": args.memory_limit, "greedy_head": args.greedy_head,
           "method": "decode: B (N-1) / (t(N) - t(1)) on fresh prompts, prefix cache off; "
                     "prefill: P / time to first token, best of 2"}
    def save():  # after every figure: a run cut short keeps what it measured
        Path(args.out).write_text(json.dumps(rec))

    ids, _ = run(vk, [PROMPT], max(args.check_cpu, 2))
    if args.profile:  # first: a slow configuration still tells where its time goes
        rec["profile"] = profile(vk, lengths)
        save()
        for what, p in rec["profile"].items():
            print(what, {k: round(v, 2) for k, v in p.items() if not isinstance(v, dict)},
                  {k: round(v, 2) for k, v in list(p.get("components_ms", {}).items())[:12]},
                  flush=True)
    for b in batches:
        rec[f"decode_b{b}_tok_s"] = decode_rate(vk, b, args.tokens, b)
        print(f"decode b{b}: {rec[f'decode_b{b}_tok_s']:.1f} tok/s", flush=True)
        save()
    for p in lengths:
        rec[f"prefill_{p}_tok_s"] = prefill_rate(vk, p)
        print(f"prefill {p}: {rec[f'prefill_{p}_tok_s']:.1f} tok/s", flush=True)
        save()
    rec["allocated_gib"] = dev.allocated / 2**30  # weights, pools, step scratch
    if args.check_cpu:
        cpu, _ = run(LLM(args.model, dtype="float32"), [PROMPT], args.check_cpu)
        rec["greedy_equal_cpu_fp32"] = cpu[0] == ids[0][:args.check_cpu]
    print(json.dumps(rec))
    Path(args.out).write_text(json.dumps(rec))


if __name__ == "__main__":
    main()
