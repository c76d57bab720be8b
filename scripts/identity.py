"""Before/after record for a change that must not move a bit: greedy tokens and every engine step's
output (logits, or the greedy head's tokens) hashed, per weight format, on the default model.

    python3 scripts/identity.py OUT.json [--device cuda] [--formats float32 bfloat16 int8 int4 q1]
    python3 scripts/identity.py --compare BEFORE.json AFTER.json

Run it on the commit before and the commit after, on one machine; --compare names every field
that differs. Three batches: six prompts of mixed lengths (prefill chunks beside decodes, shared
prefixes), twenty at once (decode steps of more than 16 rows), one prompt with logprobs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from deltaserve import LLM, SamplingParams  # noqa: E402
from deltaserve.bench.record import git_commit  # noqa: E402
from deltaserve.checkpoint.default import default_model_dir  # noqa: E402
from deltaserve.engine import runner as runner_mod  # noqa: E402
from deltaserve.quant.convert import quantize_checkpoint  # noqa: E402

BASE = "import os\n\n\ndef list_python_files(path):\n"
PROMPTS = [BASE, BASE * 3, "x = 1\n", BASE + "    # walk the tree\n", "def f(a, b):\n" * 20,
           "class A:\n    pass\n" * 7]
MANY = [f"value_{i} = {i} * {i}\n" * (1 + i % 3) for i in range(20)]
QUANTIZED = ("int8", "int4", "q1")


def record_format(fmt: str, device: str, work: Path, hashes: list[str]) -> dict:
    model, dtype = default_model_dir(), fmt
    if fmt in QUANTIZED:
        model, dtype = work / fmt, "float32"
        if not model.exists():
            quantize_checkpoint(default_model_dir(), fmt, model)
    llm = LLM(model, dtype=dtype, device=device)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    hashes.clear()
    t0 = time.perf_counter()
    mixed = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]
    many = [o.outputs[0].token_ids for o in llm.generate(MANY, greedy)]
    solo = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                    logprobs=5))[0].outputs[0]
    lps = [[round(v, 7) for v in (d or {}).values()] for d in (solo.logprobs or [])]
    return {"mixed_tokens": mixed, "many_tokens": many, "solo_tokens": solo.token_ids,
            "solo_logprobs_sha": hashlib.sha256(repr(lps).encode()).hexdigest(),
            "steps": len(hashes),
            "step_outputs_sha": hashlib.sha256("".join(hashes).encode()).hexdigest(),
            "seconds": round(time.perf_counter() - t0, 2)}


def compare(before: Path, after: Path) -> int:
    a, b = (json.loads(p.read_text())["runs"] for p in (before, after))
    bad = 0
    for fmt in sorted(set(a) | set(b)):
        diff = sorted(k for k in set(a.get(fmt, {})) | set(b.get(fmt, {}))
                      if k != "seconds" and a.get(fmt, {}).get(k) != b.get(fmt, {}).get(k))
        print(f"{fmt}: {'identical' if not diff else 'DIFFERS in ' + ', '.join(diff)}")
        bad += bool(diff)
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--formats", nargs="+", default=["float32", "bfloat16", *QUANTIZED])
    ap.add_argument("--work", default="/tmp/deltaserve-identity", help="quantized copies")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = ap.parse_args()
    if args.compare:
        return compare(*args.compare)
    torch.manual_seed(0)
    hashes: list[str] = []
    execute = runner_mod.ModelRunner.execute

    def hashed(self, *a, **kw):  # every step's output, as the engine got it
        out = execute(self, *a, **kw)
        data = out.tensor.detach().cpu().contiguous().numpy().tobytes()
        hashes.append(hashlib.sha256(data).hexdigest())
        return out

    runner_mod.ModelRunner.execute = hashed
    record = {"commit": git_commit(), "device": args.device, "torch": torch.__version__,
              "runs": {}}
    for fmt in args.formats:
        record["runs"][fmt] = run = record_format(fmt, args.device, Path(args.work), hashes)
        print(fmt, run["steps"], "steps", run["step_outputs_sha"][:16], flush=True)
    Path(args.out).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
