"""Our GGUF import against files written by llama.cpp's own converter (the recipe the GGUF issue
asks for): synthetic checkpoints with more value heads than key heads (2x tied, 3x untied as the
27B), converted by `convert_hf_to_gguf.py` from the llama-cpp-python sdist's vendored llama.cpp,
imported by `deltaserve`, and compared in fp32 with the checkpoint they came from (float outputs:
logits rel-L2 and greedy tokens) or, for Q8_0, tensor by tensor with the F32 file's import.

    pip download --no-deps --no-binary :all: llama-cpp-python -d /tmp/lcp
    tar xzf /tmp/lcp/*.tar.gz -C /tmp/lcp
    python scripts/gguf/llama_cpp_check.py --llama-cpp /tmp/lcp/llama_cpp_python-*/vendor/llama.cpp --out J
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = {"hv2x_tied": dict(linear_num_value_heads=4),
            "hv3x_untied": dict(linear_num_value_heads=6, tie_word_embeddings=False)}


def convert(llama_cpp: Path, src: Path, outtype: str, out: Path, *flags: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py")}
    run = subprocess.run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(src),
                          "--outtype", outtype, "--outfile", str(out), *flags], env=env,
                         capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"convert_hf_to_gguf.py failed:\n{run.stderr[-2000:]}")


TEXTS = ["Hello world", "def f(x):\n    return x  # c\n\n\n", "你好，世界！今日は", "🤖👩‍👩‍👧 ok",
         "   spaced   ", "\t\ttabs\r\nCRLF", "<|im_start|>user\nhi<|im_end|>\n<think>\n</think>",
         "don't I'LL", "3.14159 1e-9", "Ünïcödé e\u0301 \u212b", "<tool_call>\n</tool_call>"]


def template(folder: Path) -> str:
    path = folder / "chat_template.jinja"
    if path.is_file():
        return path.read_text()
    return json.loads((folder / "tokenizer_config.json").read_text())["chat_template"]


def tokenizer_equal(src: Path, imported: Path) -> bool:
    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(imported / "tokenizer.json"))
    theirs = Tokenizer.from_file(str(src / "tokenizer.json"))
    return all(ours.encode(t).ids == theirs.encode(t).ids for t in TEXTS)


def dequantized(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    raw = load_file(str(folder / "model.safetensors"))
    out = {}
    for name, w in raw.items():
        base = name.removesuffix(".weight")
        if name.endswith(".weight") and f"{base}.scales" in raw:
            s = raw[f"{base}.scales"].float()
            out[name] = (w.float().view(w.shape[0], s.shape[1], -1) * s[..., None]).view(
                w.shape)
        elif not name.endswith(".scales"):
            out[name] = w.float()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp", type=Path, required=True, help="vendor/llama.cpp of the sdist")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from deltaserve import LLM, SamplingParams
    from deltaserve.bench.record import git_commit
    from deltaserve.cache.sequence import prompt_logits
    from deltaserve.quant.gguf_import import import_gguf
    from tests.conftest import write_variant

    record = {"commit": git_commit(), "llama_cpp": str(args.llama_cpp), "cases": {}}
    ids = [5, 300, 41, 7, 900, 12, 1000, 77, 3]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name, overrides in VARIANTS.items():
            src = write_variant(tmp / name, 3, **overrides)
            hf = LLM(src, dtype="float32")
            want = prompt_logits(hf.model, torch.tensor([ids]))
            want_tokens = hf.generate([ids], greedy)[0].outputs[0].token_ids
            for outtype in ("f32", "bf16", "q8_0"):
                gguf = tmp / f"{name}-{outtype}.gguf"
                convert(args.llama_cpp, src, outtype, gguf)
                imported = tmp / f"{name}-{outtype}"
                import_gguf(gguf, imported)  # the file alone: its own tokenizer and template
                case = {"tokenizer_ids_equal": tokenizer_equal(src, imported),
                        "chat_template_equal": (imported / "chat_template.jinja").read_text()
                        == template(src)}
                if outtype == "q8_0":  # each tensor within Q8_0's error of the f32 file's
                    exact, quant = dequantized(tmp / f"{name}-f32"), dequantized(imported)
                    case["worst_tensor_rel"] = max(
                        ((quant[k] - exact[k]).norm() / exact[k].norm()).item() for k in exact)
                else:
                    llm = LLM(imported, dtype="float32")
                    got = prompt_logits(llm.model, torch.tensor([ids]))
                    case["logits_rel"] = ((got - want).norm() / want.norm()).item()
                    case["greedy_equal"] = llm.generate([ids], greedy)[0].outputs[0].token_ids \
                        == want_tokens
                    ours, theirs = dequantized(imported), dequantized(src)
                    mtp = [k for k in theirs if k.startswith("mtp.")]
                    case["mtp_tensors_equal"] = bool(mtp) and all(
                        k in ours and torch.equal(ours[k], theirs[k]) for k in mtp)
                record["cases"][f"{name}-{outtype}"] = case
                print(name, outtype, json.dumps(case), flush=True)
        record["cases"]["minicpm-v-tiny-f32+mmproj"] = minicpm_case(args.llama_cpp, tmp)
        print("minicpm-v", json.dumps(record["cases"]["minicpm-v-tiny-f32+mmproj"]), flush=True)
    args.out.write_text(json.dumps(record, indent=1))


def minicpm_case(llama_cpp: Path, tmp: Path) -> dict:
    """MiniCPM-V-4.6 at test size converted as llama.cpp publishes it (the text GGUF and, with
    --mmproj, the vision GGUF), side by side, loaded by --model text.gguf: an image question's
    greedy tokens and first logits against the checkpoint folder."""
    from deltaserve import LLM, SamplingParams
    from deltaserve.checkpoint.presets import preset
    from deltaserve.checkpoint.writer import write_checkpoint
    from tests.multimodal.test_engine_images import chat, our_first_logits, picture, rel_l2

    src, pair = tmp / "minicpm", tmp / "minicpm-gguf"
    write_checkpoint(preset("minicpm-v-tiny"), src, 0)
    pair.mkdir()
    convert(llama_cpp, src, "f32", pair / "MiniCPM-V-tiny-F32.gguf")
    convert(llama_cpp, src, "f32", pair / "mmproj-MiniCPM-V-tiny-F32.gguf", "--mmproj")
    folder = LLM(src, dtype="float32")
    paired = LLM(pair / "MiniCPM-V-tiny-F32.gguf", dtype="float32")
    prompt = chat(paired, [{"type": "image", "image": picture(700, 900, seed=4)},
                           {"type": "text", "text": "What is in the picture?"}])
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    return {"vision_loaded": paired.images is not None,
            "greedy_equal": paired.generate(prompt, greedy)[0].outputs[0].token_ids
            == folder.generate(prompt, greedy)[0].outputs[0].token_ids,
            "first_logits_rel": rel_l2(our_first_logits(paired, prompt),
                                       our_first_logits(folder, prompt))}


if __name__ == "__main__":
    main()
