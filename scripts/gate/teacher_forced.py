"""Teacher-forced quality of quantized models against their float model: next-token logits at every
position of the gate's prompts (deltaserve/bench/gate_prompts.json), fp32 on CPU. Writes one JSON.

    python scripts/gate/teacher_forced.py --against FLOAT_DIR --out F.json NAME=DIR [NAME=DIR ...]

Per model, over all positions of all prompts: logits rel-L2 (||a - b|| / ||b||, all positions at
once), top-1 agreement with the float model, mean and max Jensen-Shannon divergence. The gate
(`deltaserve gate`) measures free-running greedy continuations, where one early flip at a near-tie
changes everything after it; this measures every position on the same text.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from deltaserve.bench.gate import js_divergence  # noqa: E402
from deltaserve.cache.sequence import prompt_logits
from deltaserve.engine.llm import LLM  # noqa: E402

PROMPTS = Path(__file__).resolve().parents[2] / "deltaserve" / "bench" / "gate_prompts.json"


def load(model_dir: str) -> LLM:
    return LLM(model_dir, dtype="float32", prefix_cache_bytes=0, tensor_parallel_size=1)


def logits_of(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    out = []
    with torch.inference_mode():
        for ids in prompts:
            out.append(prompt_logits(llm.model, ids).float())
    return out


def compare(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict:
    la, lb = torch.cat(a), torch.cat(b)
    js = js_divergence(la, lb)
    return {"positions": la.shape[0],
            "logits_rel_l2": ((la - lb).norm() / lb.norm()).item(),
            "top1_agreement": (la.argmax(-1) == lb.argmax(-1)).float().mean().item(),
            "js_mean": js.mean().item(), "js_max": js.max().item()}


def git_commit() -> str:
    from deltaserve.bench.record import git_commit as commit

    return commit()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--against", required=True, help="the float model's folder")
    ap.add_argument("--out", required=True)
    ap.add_argument("models", nargs="+", help="NAME=DIR of each quantized model")
    args = ap.parse_args()
    for spec in args.models:
        if "=" not in spec or not all(spec.partition("=")[::2]):
            ap.error(f"models are NAME=DIR, got {spec!r}")
    ref = load(args.against)
    texts = json.loads(PROMPTS.read_text())["prompts"]
    prompts = [ref.tokenizer.encode(p["text"]) for p in texts]
    base = logits_of(ref, prompts)
    del ref
    record = {"kind": "teacher-forced-quality", "against": args.against,
              "git_commit": git_commit(), "torch": torch.__version__,
              "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "prompts": [p["id"] for p in texts],
              "models": {}}
    for spec in args.models:
        name, _, folder = spec.partition("=")
        record["models"][name] = {"dir": folder, **compare(logits_of(load(folder), prompts), base)}
        print(json.dumps({name: record["models"][name]}), flush=True)
    Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
