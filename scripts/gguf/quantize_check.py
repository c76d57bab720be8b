"""GGUF files made by llama.cpp's own tools, run by `LLM("file.gguf")` with no other input, against
transformers on the same file dequantized by the `gguf` package (what transformers' GGUF loader
does; it has no qwen35 mapping, so the dequantized tensors go through `import-gguf --dequantize`).

Synthetic checkpoints with more value heads than key heads (2x tied, 3x untied as the 27B) and
128-wide value heads (narrower than a K-quant block, as every Qwen3.5 above 2B) are converted to
F32 by `convert_hf_to_gguf.py` and quantized by `llama-quantize` to each type, so the per-tensor
mixes (Q4_K_M's Q6_K tensors, fallbacks for rows a block does not fill) are llama.cpp's own.

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/lcp
    tar xzf /tmp/lcp/llama_cpp_python-0.3.36.tar.gz -C /tmp/lcp
    L=/tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp
    cmake -S $L -B $L/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \\
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF
    cmake --build $L/build --target llama-quantize llama-bench -j2
    python scripts/gguf/quantize_check.py --llama-cpp $L --out J
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SHAPE = dict(hidden_size=256, intermediate_size=512, linear_key_head_dim=64,
             linear_value_head_dim=128)
VARIANTS = {"hv2x_tied": dict(linear_num_value_heads=4),
            "hv3x_untied": dict(linear_num_value_heads=6, tie_word_embeddings=False)}
TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "IQ4_XS", "IQ4_NL", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
         "Q2_K", "Q3_K_M", "Q1_0")


def run(cmd: list[str], **kw) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if proc.returncode:
        raise SystemExit(f"{cmd[0]} failed:\n{proc.stderr[-2000:]}")


def file_types(path: Path) -> dict[str, int]:
    import gguf

    return dict(Counter(t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors))


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp", type=Path, required=True, help="vendor/llama.cpp, built")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--types", default=",".join(TYPES))
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from deltaserve import LLM
    from deltaserve.bench.record import git_commit
    from deltaserve.errors import CheckpointError
    from deltaserve.quant.gguf_import import import_gguf
    from deltaserve.validate.compare import compare
    from deltaserve.validate.reference import load_reference
    from tests.conftest import write_variant

    quantize = args.llama_cpp / "build" / "bin" / "llama-quantize"
    record = {"commit": git_commit(), "llama_cpp": str(args.llama_cpp), "shape": SHAPE,
              "cases": {}}
    ids = [5, 300, 41, 7, 900, 12, 1000, 77, 3]
    env = {**os.environ, "PYTHONPATH": str(args.llama_cpp / "gguf-py")}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        os.environ["DELTASERVE_CACHE_DIR"] = str(tmp / "cache")
        for variant, overrides in VARIANTS.items():
            src = write_variant(tmp / variant, 3, **SHAPE, **overrides)
            f32 = tmp / f"{variant}-f32.gguf"
            run([sys.executable, str(args.llama_cpp / "convert_hf_to_gguf.py"), str(src),
                 "--outtype", "f32", "--outfile", str(f32)], env=env)
            for qtype in args.types.split(","):
                path = tmp / f"{variant}-{qtype}.gguf"
                run([str(quantize), str(f32), str(path), qtype])
                case = {"file_bytes": path.stat().st_size, "types": file_types(path)}
                llm = LLM(path, dtype="float32")  # the file alone
                case["weight_bytes"] = weight_bytes(llm.model)
                try:
                    import_gguf(path, tmp / f"{variant}-{qtype}-ref", dequantize=True)
                except CheckpointError as exc:  # Q1_0: the gguf package has no dequantizer
                    case["reference"] = str(exc)
                else:
                    ref = load_reference(tmp / f"{variant}-{qtype}-ref")
                    c = compare(llm, ref, ids, 16)
                    case.update(logits_rel_l2=c.logits_rel_l2, greedy_equal=c.num_greedy_equal,
                                greedy_tokens=c.num_greedy_tokens,
                                first_divergence=c.first_divergence)
                record["cases"][f"{variant}-{qtype}"] = case
                print(variant, qtype, json.dumps(case), flush=True)
                path.unlink()
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
