"""A synthetic GGUF at a preset's real shape, as llama.cpp's converter then `llama-quantize Q1_0`
would lay it out: `qwen35` metadata, the embedded tokenizer and chat template, the converter's
tensor names (the MTP block as `blk.{layers}.*`), and llama-quantize's types for Q1_0 (every
matrix Q1_0, the output head (or the tied embedding) Q6_K, Q8_0 where its rows are not whole
Q6_K blocks, vectors and the conv F32).

The matrices are random blocks written directly (random sign bits, d near mean|N(0, 0.02)|),
never floats first: the 27B's 55 GB of bf16 would not fit a GPU machine's disk, its 3.9 GB of
blocks do. Values are random, so the converter's value-head reordering has nothing to reorder;
the layout (names, shapes, types, the tiled order's axes) is exactly the converter's.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deltaserve.checkpoint.synthetic import TensorSpec, lm_specs, mtp_specs
from deltaserve.errors import CheckpointError, ConfigError
from deltaserve.progress import bar

BLOCKS = {"Q1_0": (128, 18), "Q6_K": (256, 210), "Q8_0": (32, 34)}  # weights, bytes
FORMATS = ("gguf-q1_0",)


def text_of(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config of a preset (flat, or nested under text_config)."""
    if config.get("model_type") == "minicpmv4_6":
        raise ConfigError("a synthetic GGUF is written for Qwen3.5 presets only (qwen35)")
    return config.get("text_config", config)


def gguf_plan(cfg: dict[str, Any]) -> list[tuple[TensorSpec, str, str]]:
    """(HF spec, GGUF name, GGUF type) of every tensor of the file."""
    from deltaserve.quant.gguf_import import gguf_name

    layers = cfg["num_hidden_layers"]
    specs = lm_specs(cfg, "model.", True) + (mtp_specs(cfg) if cfg.get("mtp_num_hidden_layers")
                                             else [])
    plan = []
    for spec in specs:
        name = gguf_name(spec.name, layers)
        head = name == "output.weight" or (name == "token_embd.weight"
                                           and cfg["tie_word_embeddings"])
        if len(spec.shape) != 2:
            qtype = "F32"
        elif head:  # llama-quantize: Q6_K, else its fallback for rows of other widths
            qtype = "Q6_K" if spec.shape[-1] % BLOCKS["Q6_K"][0] == 0 else "Q8_0"
        else:
            qtype = "Q1_0"
        block = BLOCKS.get(qtype, (1, 4))[0]
        if spec.shape[-1] % block:
            raise ConfigError(f"{spec.name}: {spec.shape[-1]} columns are not whole {qtype} "
                              f"blocks of {block}")
        plan.append((spec, name, qtype))
    return plan


def gguf_bytes(cfg: dict[str, Any]) -> int:
    """Tensor bytes of the file (headers and tokenizer apart)."""
    total = 0
    for spec, _, qtype in gguf_plan(cfg):
        block, size = BLOCKS.get(qtype, (1, 4))
        total += math.prod(spec.shape) // block * size
    return total


def _q1_0(rows: int, cols: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """Random Q1_0 rows: per 128 weights an fp16 d (mean|x| of N(0, std): std * sqrt(2/pi), with
    its sampling spread) and 16 bytes of sign bits."""
    blocks = rows * cols // 128
    d = std * math.sqrt(2 / math.pi) * (1 + 0.053 * rng.standard_normal(blocks, np.float32))
    out = np.empty((blocks, 18), np.uint8)
    out[:, :2] = d.astype(np.float16).view(np.uint8).reshape(blocks, 2)
    out[:, 2:] = rng.integers(0, 256, (blocks, 16), np.uint8)
    return out.reshape(rows, -1)


def _q6_k(rows: int, cols: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """Random Q6_K rows: random 6-bit codes (q - 32 has std 18.5), int8 sub-scales near 16, and
    d so that the values have std `std` (block: ql[128] qh[64] scales[16] d)."""
    blocks = rows * cols // 256
    out = rng.integers(0, 256, (blocks, 210), np.uint8)
    out[:, 192:208] = rng.integers(12, 21, (blocks, 16), np.uint8)
    d = np.full(blocks, std / (16 * 18.5), np.float16)
    out[:, 208:210] = d.view(np.uint8).reshape(blocks, 2)
    return out.reshape(rows, -1)


def _q8_0(rows: int, cols: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """Random Q8_0 rows: per 32 weights an fp16 d and 32 int8 codes uniform in [-127, 127]
    (std 73.3), d so that the values have std `std`."""
    blocks = rows * cols // 32
    out = np.empty((blocks, 34), np.uint8)
    out[:, :2] = np.full(blocks, std / 73.3, np.float16).view(np.uint8).reshape(blocks, 2)
    out[:, 2:] = rng.integers(-127, 128, (blocks, 32), np.int8).view(np.uint8)
    return out.reshape(rows, -1)


_RANDOM = {"Q1_0": _q1_0, "Q6_K": _q6_k, "Q8_0": _q8_0}


def _vector(spec: TensorSpec, gen: torch.Generator, std: float) -> np.ndarray:
    """A float tensor as the converter stores it: (1 + w) norms with the 1 added, A_log as
    ssm_a = -exp(A_log), the conv [C, 1, K] as [C, K]."""
    from deltaserve.checkpoint.writer import init_tensor
    from deltaserve.quant.gguf_import import stored_plus_one

    x = init_tensor(spec, gen, std).float()
    if spec.name.endswith("A_log"):
        x = -x.exp()
    elif spec.name.endswith("conv1d.weight"):
        x = x[:, 0, :]
    elif stored_plus_one(spec.name):
        x = x + 1.0
    return np.ascontiguousarray(x.numpy())


def write_synthetic_gguf(cfg: dict[str, Any], path: Path, seed: int = 0,
                         name: str = "synthetic") -> dict:
    """Write the Q1_0 GGUF of text config `cfg` to path, tensor by tensor (a progress bar on stderr);
    returns a summary (tensors, bytes, types)."""
    try:
        import gguf
    except ImportError as exc:
        raise CheckpointError("writing GGUF needs the gguf package: pip install "
                              "'deltaserve[gguf]'") from exc
    plan, total = gguf_plan(cfg), gguf_bytes(cfg)
    # the bar opens before the tokenizer's metadata (248k tokens and merges: seconds to pack)
    with bar(total, f"writing {path.name}", "B", unit_scale=True) as shown:
        shown.set_postfix_str("tokenizer and metadata")
        writer = gguf.GGUFWriter(str(path), "qwen35")
        writer.add_name(name)
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q1_0)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        _write_hparams(writer, cfg)
        with tempfile.TemporaryDirectory() as tmp:
            _write_tokenizer(writer, Path(tmp), cfg["vocab_size"])
        _add_tensor_infos(writer, plan, gguf)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        shown.set_postfix_str("tensors")
        rng, gen = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
        std = float(cfg.get("initializer_range", 0.02))
        for spec, _, qtype in plan:
            rows, cols = math.prod(spec.shape[:-1]), spec.shape[-1]
            data = _RANDOM[qtype](rows, cols, std, rng) if qtype in _RANDOM else \
                _vector(spec, gen, std)
            writer.write_tensor_data(data)
            shown.update(data.nbytes)
    writer.close()
    types: dict[str, int] = {}
    for _, _, qtype in plan:
        types[qtype] = types.get(qtype, 0) + 1
    return {"path": str(path), "num_tensors": len(plan), "tensor_bytes": total,
            "file_bytes": path.stat().st_size, "types": types}


def _add_tensor_infos(writer, plan, gguf) -> None:
    for spec, gname, qtype in plan:
        shape = (*spec.shape[:-1], _row_bytes(spec.shape[-1], qtype)) if qtype != "F32" else \
            _float_shape(spec)
        dtype = np.uint8 if qtype != "F32" else np.float32
        writer.add_tensor_info(gname, shape, np.dtype(dtype), math.prod(shape) * np.dtype(dtype)
                               .itemsize, raw_dtype=None if qtype == "F32" else
                               gguf.GGMLQuantizationType[qtype])


def _row_bytes(cols: int, qtype: str) -> int:
    block, size = BLOCKS[qtype]
    return cols // block * size


def _float_shape(spec: TensorSpec) -> tuple[int, ...]:
    return (spec.shape[0], spec.shape[2]) if spec.name.endswith("conv1d.weight") else spec.shape


def _write_hparams(w, cfg: dict[str, Any]) -> None:
    """The `qwen35.*` keys llama.cpp's converter writes for this family."""
    a, rope = "qwen35.", cfg["rope_parameters"]
    hv, dv = cfg["linear_num_value_heads"], cfg["linear_value_head_dim"]
    mtp = cfg.get("mtp_num_hidden_layers", 0)
    for key, val in (("block_count", cfg["num_hidden_layers"] + mtp),
                     ("context_length", cfg["max_position_embeddings"]),
                     ("embedding_length", cfg["hidden_size"]),
                     ("feed_forward_length", cfg["intermediate_size"]),
                     ("attention.head_count", cfg["num_attention_heads"]),
                     ("attention.head_count_kv", cfg["num_key_value_heads"]),
                     ("attention.key_length", cfg["head_dim"]),
                     ("attention.value_length", cfg["head_dim"]),
                     ("ssm.conv_kernel", cfg["linear_conv_kernel_dim"]),
                     ("ssm.state_size", cfg["linear_key_head_dim"]),
                     ("ssm.group_count", cfg["linear_num_key_heads"]),
                     ("ssm.time_step_rank", hv), ("ssm.inner_size", hv * dv),
                     ("full_attention_interval", cfg["full_attention_interval"]),
                     ("rope.dimension_count",
                      int(cfg["head_dim"] * rope["partial_rotary_factor"]))):
        w.add_uint32(a + key, val)
    if mtp:
        w.add_uint32(a + "nextn_predict_layers", mtp)
    w.add_float32(a + "attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    w.add_float32(a + "rope.freq_base", float(rope["rope_theta"]))
    w.add_array(a + "rope.dimension_sections", [*rope["mrope_section"], 0])


def _write_tokenizer(w, tmp: Path, vocab_size: int) -> None:
    """The Qwen3.5 tokenizer as the converter's gpt2 vocabulary: ids padded to the model's
    vocabulary with unused [PADn], special added tokens control (3), other added tokens
    user-defined (4), merges as "a b", pre-tokenizer `qwen35`, the chat template."""
    import json

    from deltaserve.checkpoint.writer import write_tokenizer

    write_tokenizer(tmp)
    tok = json.loads((tmp / "tokenizer.json").read_text(encoding="utf-8"))
    conf = json.loads((tmp / "tokenizer_config.json").read_text(encoding="utf-8"))
    tokens, types = [f"[PAD{i}]" for i in range(vocab_size)], [5] * vocab_size
    for text, i in tok["model"]["vocab"].items():
        tokens[i], types[i] = text, 1
    for added in tok["added_tokens"]:
        tokens[added["id"]], types[added["id"]] = added["content"], 3 if added["special"] else 4
    ids = {t: i for i, t in enumerate(tokens)}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen35")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m
                        for m in tok["model"]["merges"]])
    w.add_add_bos_token(False)
    w.add_eos_token_id(ids[conf["eos_token"]])
    w.add_pad_token_id(ids[conf["pad_token"]])
    template = tmp / "chat_template.jinja"
    w.add_chat_template(template.read_text(encoding="utf-8") if template.is_file()
                        else conf["chat_template"])
