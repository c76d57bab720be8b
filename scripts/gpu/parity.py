"""H200: GPU greedy output against the CPU engine, for both GPU backends (issue 6's "Must show").

    python3 scripts/gpu/parity.py --model DIR --out OUT.json

16 prompts (random ids, 8..300 tokens) x 64 greedy tokens through the batched engine, on the
given checkpoint and on the trained default model:
1. fp32 on CUDA (TF32 off) vs fp32 on CPU: tokens identical? (first divergence per prompt)
2. bf16 on CUDA vs fp32 on CUDA, the quality gate's measures: exact agreement and the
   Jensen-Shannon divergence of next-token distributions, teacher-forced on the fp32 tokens.
Each backend (triton, portable) runs 1 and 2; the CPU reference runs once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from deltaserve import LLM, SamplingParams  # noqa: E402
from deltaserve.bench.gate import js_divergence, teacher_forced  # noqa: E402
from deltaserve.bench.record import device_info, git_commit  # noqa: E402
from deltaserve.env import env  # noqa: E402

NUM_PROMPTS, NUM_TOKENS = 16, 64


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    lens = torch.linspace(8, 300, NUM_PROMPTS).long().tolist()
    return [torch.randint(0, min(vocab, 248044), (n,), generator=gen).tolist() for n in lens]


def greedy(llm, ps) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params)
    return [o.outputs[0].token_ids for o in outs]


def compare(a: list[list[int]], b: list[list[int]]) -> dict:
    firsts = [next((i for i, (x, y) in enumerate(zip(s, t, strict=True)) if x != y), None)
              for s, t in zip(a, b, strict=True)]
    return {"identical_prompts": sum(f is None for f in firsts), "prompts": len(firsts),
            "first_divergence": firsts}


def run_backend(model: Path, backend: str, ps, cpu_tokens) -> dict:
    os.environ["DELTASERVE_GPU_BACKEND"] = backend
    env.cache_clear()
    out: dict = {"backend": backend}
    fp32 = LLM(model, dtype="float32", device="cuda")
    t0 = time.perf_counter()
    tokens32 = greedy(fp32, ps)
    out["fp32_s"] = time.perf_counter() - t0
    out["fp32_vs_cpu"] = compare(tokens32, cpu_tokens)
    bf16 = LLM(model, dtype="bfloat16", device="cuda")
    tokens16 = greedy(bf16, ps)
    agree = [sum(x == y for x, y in zip(a, b, strict=True)) / NUM_TOKENS
             for a, b in zip(tokens16, tokens32, strict=True)]
    js = []
    for p, cont in zip(ps, tokens32, strict=True):
        la = teacher_forced(bf16, p, cont)
        lb = teacher_forced(fp32, p, cont)
        js.append(js_divergence(la.float().cpu(), lb.float().cpu()))
    js = torch.cat(js)
    out["bf16_vs_fp32"] = {"mean_agreement": sum(agree) / len(agree), "min_agreement": min(agree),
                           "js_mean": js.mean().item(), "js_max": js.max().item(),
                           "nonfinite": int((~torch.isfinite(js)).sum())}
    del fp32, bf16
    torch.cuda.empty_cache()
    return out


def check_model(model: Path) -> dict:
    cpu = LLM(model, dtype="float32", device="cpu")
    ps = prompts(cpu.config.vocab_size)
    t0 = time.perf_counter()
    cpu_tokens = greedy(cpu, ps)
    return {"model": str(model), "cpu_s": time.perf_counter() - t0,
            "backends": [run_backend(model, b, ps, cpu_tokens) for b in ("triton", "portable")]}


def main() -> int:
    from deltaserve.checkpoint.default import default_model_dir

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True, help="e.g. the 0.8B synthetic checkpoint")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    record = {"kind": "gpu-parity", "git_commit": git_commit(), "device": device_info("cuda"),
              "prompts": NUM_PROMPTS, "tokens": NUM_TOKENS,
              # random weights give near-flat logits (bf16 flips tokens at once); the trained
              # default model shows what bf16 costs on real distributions
              "models": [check_model(args.model), check_model(default_model_dir())]}
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    for m in record["models"]:
        for b in m["backends"]:
            print(Path(m["model"]).name, b["backend"], "fp32 vs cpu:",
                  b["fp32_vs_cpu"]["identical_prompts"], "/", NUM_PROMPTS,
                  "identical; bf16 vs fp32:", b["bf16_vs_fp32"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
