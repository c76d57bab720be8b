"""H200: quantized checkpoints end to end on CUDA (parity against the CPU engine, then speed).

    python3 scripts/gpu/quant_check.py --out OUT.json

Writes the 0.8B-shape synthetic checkpoint, quantizes it (int8, int4), and per format: logits of
the same quantized checkpoint on CUDA fp32 vs CPU fp32 (prefill over 64 tokens; TF32 off) and 16
greedy tokens (the Triton decode GEMV on CUDA against the C GEMV on CPU); then bf16 on CUDA:
prefill tok/s at 512 and 2048, decode tok/s over 128 tokens (eager: no CUDA graphs yet).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from deltaserve import LLM, SamplingParams  # noqa: E402
from deltaserve.bench.record import device_info, git_commit  # noqa: E402
from deltaserve.cache.sequence import prompt_logits
from deltaserve.checkpoint.presets import preset  # noqa: E402
from deltaserve.checkpoint.writer import write_checkpoint  # noqa: E402
from deltaserve.quant.convert import quantize_checkpoint  # noqa: E402


def ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 248044, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def parity(model_dir: Path) -> dict:
    prompt = ids(64)
    out = {}
    logits, tokens = {}, {}
    for device in ("cpu", "cuda"):
        llm = LLM(model_dir, dtype="float32", device=device)
        x = torch.tensor([prompt], device=device)
        logits[device] = prompt_logits(llm.model, x)[None].float().cpu()
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        tokens[device] = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
        del llm
    diff = (logits["cuda"] - logits["cpu"]).norm() / logits["cpu"].norm()
    out["logits_rel_l2_cuda_vs_cpu"] = diff.item()
    out["greedy_equal"] = sum(a == b for a, b in zip(tokens["cuda"], tokens["cpu"], strict=True))
    return out


def speed(model_dir: Path) -> dict:
    llm = LLM(model_dir, dtype="bfloat16", device="cuda", prefix_cache_bytes=0)
    out = {"gpu_mem_gb": torch.cuda.max_memory_allocated() / 1e9}
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for n in (512, 2048):
        prompt = ids(n, seed=n)
        llm.generate([prompt], one)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            llm.generate([prompt], one)
        torch.cuda.synchronize()
        out[f"prefill_{n}_tok_s"] = 3 * n / (time.perf_counter() - t0)
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    llm.generate([ids(16)], params)
    out["decode_tok_s"] = llm.generate([ids(16)], params)[0].metrics["decode_tok_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    work = Path(tempfile.mkdtemp())
    write_checkpoint(preset("qwen3.5-0.8b"), work / "bf16", seed=0)
    record = {"git_commit": git_commit(), "device": device_info("cuda"), "formats": {}}
    for fmt in ("bf16", "int8", "int4"):
        d = work / fmt
        if fmt != "bf16":
            quantize_checkpoint(work / "bf16", fmt, d)
        entry = {"file_bytes": sum(f.stat().st_size for f in d.glob("*.safetensors"))}
        for name, fn in (("parity", parity), ("speed", speed)):
            if name == "parity" and fmt == "bf16":
                continue
            try:
                entry[name] = fn(d)
            except Exception as exc:  # one call should report everything
                entry[name] = {"error": f"{type(exc).__name__}: {exc}"}
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        record["formats"][fmt] = entry
        print(json.dumps({fmt: entry}), flush=True)
    Path(args.out).write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
