"""H200: is the short-prefill graph path as accurate as the eager one? First-token logits of short
prompts on the tiny and 0.8B shapes in bf16 with graphs, bf16 eager, and fp32 eager (the reference):
rel-L2 of each bf16 path against fp32, and between them.

    python3 scripts/gpu/prefill_graph_accuracy.py --out prefill_graph_accuracy.json
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from deltaserve import LLM, SamplingParams  # noqa: E402
from deltaserve.checkpoint.presets import preset  # noqa: E402
from deltaserve.checkpoint.writer import write_checkpoint  # noqa: E402


def first_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    seen = []
    execute = llm.engine.runner.execute

    def wrapped(plan, all_ids, feed=None, images=None, hidden=False):
        out = execute(plan, all_ids, feed, images, hidden)
        seen.extend(out[rid].float().cpu() for rid in out)
        return out

    llm.engine.runner.execute = wrapped
    llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    llm.engine.runner.execute = execute
    return seen[0]


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="prefill_graph_accuracy.json")
    args = ap.parse_args()
    record = {}
    for name in ("tiny", "qwen3.5-0.8b"):
        work = Path(tempfile.mkdtemp()) / name
        write_checkpoint(preset(name), work, seed=0)
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(1, 1000, (n,), generator=g).tolist() for n in (7, 30, 60, 100)]
        runs = {}
        for label, dtype, graphs in (("bf16_graph", "bfloat16", True),
                                     ("bf16_eager", "bfloat16", False), ("fp32", "float32", False)):
            llm = LLM(work, dtype=dtype, device="cuda", prefix_cache_bytes=0)
            if not graphs:
                llm.engine.runner.prefill_graphs = None
            elif llm.engine.runner.prefill_graphs is None:
                raise SystemExit("prefill graphs are off here")
            runs[label] = [first_logits(llm, ids) for ids in prompts]
            del llm
        rows = []
        for i, ids in enumerate(prompts):
            a, b, c = runs["bf16_graph"][i], runs["bf16_eager"][i], runs["fp32"][i]
            rows.append({"tokens": len(ids), "graph_vs_fp32": rel(a, c), "eager_vs_fp32": rel(b, c),
                         "graph_vs_eager": rel(a, b), "argmax_equal": [int(a.argmax()) == int(c.argmax()),
                                                                      int(b.argmax()) == int(c.argmax())]})
            print(name, rows[-1], flush=True)
        record[name] = rows
    Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
