"""Decode speed with the CPU kernels built for another instruction set than this machine's best:
what a laptop without AVX-512 gets (AVX2 + FMA: -march=haswell), measured on an AVX-512 machine.

    python scripts/cpu/isa_bench.py --arch haswell [--models default,DIR,...] [--out FILE.json]

Per model (bf16 activations path, greedy, EOS ignored): decode tok/s at batch 1 and 4 after a
warm-up, kernel GEMV µs on the 0.8B in_proj shape (8224 x 1024) per format. Works on older trees
too (their native module had no build(march): the flags are patched instead), so a before/after
pair runs the same script.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path.cwd()))  # the tree being measured (run from its root)
import deltaserve.ops.native as nat  # noqa: E402
from deltaserve import LLM, SamplingParams  # noqa: E402
from deltaserve.bench.record import device_info, git_commit  # noqa: E402


def use_arch(arch: str) -> None:
    if arch == "native":
        return
    if hasattr(nat, "build"):
        nat._lib, nat._tried = nat.build(arch), True
    else:  # trees before build(march)
        nat._FLAGS = [f if not f.startswith("-march=") else f"-march={arch}" for f in nat._FLAGS]


def best_ms(fn, reps: int = 20) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def kernels() -> dict:
    from deltaserve.ops.gemv import gemv
    from deltaserve.ops.qgemv import qgemv
    from deltaserve.quant.schemes import FORMATS, quantize

    n, k = 8224, 1024
    x = torch.randn(1, k)
    w = torch.randn(n, k).bfloat16()
    out = {"bf16_gemv_us": 1e3 * best_ms(lambda: gemv(x, w))}
    for name in ("int8", "int4", "q1"):
        scheme = FORMATS[name]
        p = {key: v.float() if v.is_floating_point() else v
             for key, v in quantize(torch.randn(n, k), scheme).items()}
        out[f"{name}_gemv_us"] = 1e3 * best_ms(lambda p=p, s=scheme: qgemv(x, p, s))
    return out


def decode(model: str) -> dict:
    llm = LLM(None if model == "default" else model, dtype="bfloat16")
    out = {}
    for batch, tokens in ((1, 64), (4, 32)):
        prompts = [[3 + i, 14, 15, 92, 65, 35] for i in range(batch)]
        llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params)
        out[f"batch_{batch}_decode_tok_s"] = batch * tokens / (time.perf_counter() - start)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="haswell", help="-march= value (native: this machine's)")
    ap.add_argument("--models", default="default")
    ap.add_argument("--out")
    args = ap.parse_args()
    use_arch(args.arch)
    lib = nat.native_lib()
    record = {"kind": "cpu-isa-bench", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "git_commit": git_commit(), "device": device_info("cpu"), "arch": args.arch,
              "vnni": lib is not None and hasattr(lib, "ds_gemv_q8_vnni"),
              "kernels": kernels(), "models": {}}
    for model in args.models.split(","):
        record["models"][model] = decode(model)
        print(model, {k: round(v, 1) for k, v in record["models"][model].items()}, flush=True)
    print({k: round(v, 1) for k, v in record["kernels"].items()})
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
