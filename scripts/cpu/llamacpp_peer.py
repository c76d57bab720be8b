"""Our CPU decode and prefill against llama.cpp's llama-bench on the same model, back to back.

    python scripts/cpu/llamacpp_peer.py --llama-bench PATH/llama-bench \
        --pair /tmp/q08_int8=/tmp/q08_q8_0.gguf --pair /tmp/q08_int4=/tmp/q08_q4_0.gguf \
        --out peer.json

Each pair is (our checkpoint folder, the GGUF of the same weights: convert_hf_to_gguf.py from the
bf16 folder, `--outtype q8_0`, or llama-quantize). Per pair, alternating ours / llama.cpp `rounds`
times: our `deltaserve bench` (prefill 512, decode 128 after 16 tokens, 2 threads) and
`llama-bench -t 2 -p 512 -n 128` (pp512, tg128). The machine's memory read rate is measured in
each of our runs (its bandwidth drifts run to run on this shared VM). One JSON with every run.
Not a CI test: llama.cpp is not a dependency (build it from the llama-cpp-python sdist's vendor/).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from deltaserve.bench.record import device_info, git_commit  # noqa: E402
from deltaserve.ops.native import isa_paths  # noqa: E402


def ours(model: str, threads: int, prompt: int, tokens: int, repeats: int,
         device: str = "cpu") -> dict:
    """Our `deltaserve bench` on the model; on CUDA bf16 activations with its CUDA graphs."""
    where = ["--dtype", "auto"] if device == "cpu" else ["--device", device, "--formats", "bf16"]
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([sys.executable, "-m", "deltaserve", "bench", "--model", model, *where,
                        "--prefill-lens", str(prompt or ""), "--decode-tokens",
                        str(tokens), "--repeats", str(repeats), "--peer", "none", "--out", f.name],
                       check=True, capture_output=True,
                       env={**os.environ, "DELTASERVE_NUM_THREADS": str(threads)})
        rec = json.loads(Path(f.name).read_text())
    eng = rec["engines"]["deltaserve" if device == "cpu" else "deltaserve-bf16"]
    out = {"dtype": rec.get("dtype", "bfloat16"), "decode_tok_s": eng["decode_tok_s"],
           "roofline_pct": eng.get("roofline_pct"), "bytes_per_token": eng.get("bytes_per_token"),
           "memory_read_gbs": rec.get("memory_read_gbs"), "copy_gbs": rec.get("copy_gbs")}
    if device != "cpu":
        out.update(decode_greedy_head_tok_s=eng.get("decode_greedy_head_tok_s"),
                   gpu_mem_gb=eng.get("gpu_mem_gb"))
    if prompt:
        out[f"prefill_{prompt}_tok_s"] = eng[f"prefill_{prompt}_tok_s"]
    return out


def llama(binary: str, gguf: str, threads: int, prompt: int, tokens: int, repeats: int,
          device: str = "cpu") -> dict:
    """llama-bench on the file; on CUDA every layer offloaded, flash attention on."""
    gpu = [] if device == "cpu" else ["-ngl", "99", "-fa", "1"]
    proc = subprocess.run([binary, "-m", gguf, "-t", str(threads), *gpu, "-p", str(prompt), "-n",
                           str(tokens), "-r", str(repeats), "-o", "json"], check=True,
                          capture_output=True, text=True)
    rows = json.loads(proc.stdout)
    out = {"build_commit": rows[0].get("build_commit"), "model_type": rows[0].get("model_type"),
           "model_size": rows[0].get("model_size")}
    for r in rows:
        key = f"prefill_{r['n_prompt']}_tok_s" if r["n_prompt"] else "decode_tok_s"
        out[key] = r["avg_ts"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-bench", required=True)
    ap.add_argument("--pair", action="append", required=True, help="OURS_DIR=GGUF")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=512,
                    help="prefill length timed (0: decode only, for a build whose prefill fails)")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per run, each side")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (llama.cpp built with CUDA)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    # the knobs that restrict our kernels and torch's to an instruction set (an AVX2-only
    # machine emulated on a larger one), as the runs below inherit them
    isa_env = {k: os.environ[k] for k in ("DELTASERVE_CPU_MARCH", "ATEN_CPU_CAPABILITY",
                                          "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA",
                                          "DELTASERVE_EXACT_INT8_ACT")
               if k in os.environ}
    record = {"kind": f"{args.device}-llamacpp-peer", "git_commit": git_commit(),
              "device": device_info(args.device), "threads": args.threads, "prompt": args.prompt,
              "decode_tokens": args.decode_tokens, "repeats": args.repeats,
              "llama_bench": args.llama_bench, "isa_env": isa_env,
              "isa_paths": list(isa_paths()), "pairs": {}}
    for pair in args.pair:
        model, gguf = pair.split("=", 1)
        runs = []
        for _ in range(args.rounds):
            n, r = args.decode_tokens, args.repeats
            runs.append({"deltaserve": ours(model, args.threads, args.prompt, n, r, args.device),
                         "llama.cpp": llama(args.llama_bench, gguf, args.threads, args.prompt, n,
                                            r, args.device)})
            print(json.dumps(runs[-1]), file=sys.stderr)
        keys = ["decode_tok_s"] + ([f"prefill_{args.prompt}_tok_s"] if args.prompt else [])
        med = {e: {k: statistics.median(r[e][k] for r in runs) for k in keys} for e in runs[0]}
        record["pairs"][pair] = {"runs": runs, "median": med, **{
            f"{k.split('_')[0]}_ratio": med["deltaserve"][k] / med["llama.cpp"][k] for k in keys}}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({p: {k: v for k, v in r.items() if k != "runs"}
                      for p, r in record["pairs"].items()}, indent=1))


if __name__ == "__main__":
    main()
