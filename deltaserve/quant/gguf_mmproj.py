"""MiniCPM-V-4.6's vision GGUF (llama.cpp's "mmproj" file) beside its language-model GGUF.

llama.cpp's converter writes MiniCPM-V-4.6 as two files: the Qwen3.5 text model (architecture
`qwen35`, read by quant/gguf_import) and the vision tower + projector (architecture `clip`,
projector type `minicpmv4_6`). The vision tensors keep their values and shapes and only change
names (formats.md, the GGUF section), so they map back one to one; the vision config comes from
the `clip.vision.*` keys and the tensors' shapes. Users pass the file with `--mmproj FILE` (as
llama-server), or keep one `mmproj*.gguf` beside the model file, which is then taken and named.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch

from deltaserve.errors import CheckpointError

PROJECTOR = "minicpmv4_6"
_TOWER = "model.vision_tower"
_FIXED = {
    "v.patch_embd": f"{_TOWER}.embeddings.patch_embedding",
    "v.position_embd": f"{_TOWER}.embeddings.position_embedding",
    "v.post_ln": f"{_TOWER}.post_layernorm",
    "mm.up": "model.merger.mlp.0.linear_1",
    "mm.down": "model.merger.mlp.0.linear_2",
    "mm.input_norm": "model.merger.mlp.0.pre_norm",
}
_ATTN = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_out": "self_attn.out_proj"}
_LAYER = {"ln1": "layer_norm1", "ln2": "layer_norm2", "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2",
          **_ATTN}
_MERGER = {"ln1": "layer_norm1", "ds_ffn_up": "linear_1", "ds_ffn_down": "linear_2",
           "ds_ln": "pre_norm", **_ATTN}
_NAME = re.compile(r"^(?:v\.blk\.(\d+)|v\.vit_merger)\.(\w+)\.(weight|bias)$")


def hf_vision_name(name: str) -> str | None:
    """The checkpoint name of an mmproj tensor (None: not one of MiniCPM-V-4.6's)."""
    stem, _, leaf = name.rpartition(".")
    if stem in _FIXED and leaf in ("weight", "bias"):
        return f"{_FIXED[stem]}.{leaf}"
    m = _NAME.match(name)
    if m is None:
        return None
    layer, part, leaf = m.groups()
    if layer is not None:
        return f"{_TOWER}.encoder.layers.{layer}.{_LAYER[part]}.{leaf}" if part in _LAYER else None
    return f"{_TOWER}.vit_merger.{_MERGER[part]}.{leaf}" if part in _MERGER else None


def find_mmproj(model_file: Path) -> Path | None:
    """The one `mmproj*.gguf` beside a model file (None if there is none); several are refused."""
    found = sorted(p for p in model_file.parent.glob("*.gguf")
                   if p.name.lower().startswith("mmproj") and p.resolve() != model_file.resolve())
    if len(found) > 1:
        raise CheckpointError(f"{len(found)} mmproj files beside {model_file.name} "
                              f"({', '.join(p.name for p in found)}): choose one with --mmproj "
                              "FILE, or --no-mmproj for text only")
    return found[0] if found else None


def read_mmproj(path: Path, text_hidden: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(the config.json keys of a minicpmv4_6 checkpoint but text_config, the vision tensors as
    fp32) of an mmproj file for a language model of width text_hidden."""
    from deltaserve.quant.gguf_import import _float
    from deltaserve.quant.gguf_read import read_gguf

    try:
        reader = read_gguf(path)
    except (ValueError, OSError) as exc:
        raise CheckpointError(f"cannot read mmproj file {path}: {exc}") from exc
    meta = reader.meta
    kind = meta.get("clip.projector_type")
    if meta.get("general.architecture") != "clip" or kind != PROJECTOR:
        raise CheckpointError(f"{path.name} is not a MiniCPM-V-4.6 mmproj file (architecture "
                              f"{meta.get('general.architecture')!r}, projector {kind!r}; "
                              f"supported: clip / {PROJECTOR})")
    tensors = {}
    for t in reader.tensors:
        name = hf_vision_name(t.name)
        if name is None:
            raise CheckpointError(f"{path.name}: tensor '{t.name}' is not one of MiniCPM-V-4.6's")
        tensors[name] = _float(t, name).float().contiguous()
    return _config(meta, tensors, text_hidden, path.name), tensors


def _config(meta: dict, tensors: dict, text_hidden: int, where: str) -> dict[str, Any]:
    def get(key):
        value = meta.get(f"clip.vision.{key}")
        if value is None:
            raise CheckpointError(f"{where}: metadata lacks clip.vision.{key}")
        return value

    if int(get("projection_dim")) != text_hidden:
        raise CheckpointError(f"{where} projects to width {int(get('projection_dim'))}, the "
                              f"language model is {text_hidden} wide: not its mmproj")
    scale = int(get("projector.scale_factor"))
    if scale != 4:  # 4x files drop the window merger; the tower here always runs it
        raise CheckpointError(f"{where}: projector scale factor {scale} (downsample 4x) is not "
                              "supported; convert with downsample_mode 16x")
    if not meta.get("clip.use_gelu", False):
        raise CheckpointError(f"{where}: the tower's activation is not tanh GELU")
    key = f"{_TOWER}.embeddings.position_embedding.weight"
    if key not in tensors:
        raise CheckpointError(f"{where} has no position embedding table")
    side, patch = math.isqrt(tensors[key].shape[0]), int(get("patch_size"))
    vision = {
        "model_type": "minicpmv4_6_vision", "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": int(get("embedding_length")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": int(get("attention.head_count")), "num_channels": 3,
        # the file's image_size is the slice size (448); the table's side in pixels is the model's
        "image_size": side * patch, "patch_size": patch,
        "layer_norm_eps": float(get("attention.layer_norm_epsilon")),
    }
    insert = list(meta.get("clip.vision.wa_layer_indexes") or [6])[0]
    return {"architectures": ["MiniCPMV4_6ForConditionalGeneration"], "model_type": PROJECTOR,
            "vision_config": vision, "insert_layer_id": int(insert), "downsample_mode": "16x"}


def with_vision(text: dict, tensors: dict, mmproj: Path) -> tuple[dict, dict]:
    """The MiniCPM-V-4.6 checkpoint of a text GGUF and its mmproj file: config and tensors."""
    top, vision = read_mmproj(mmproj, int(text["hidden_size"]))
    prefixed = {("model.language_model." + k.removeprefix("model.")) if k.startswith("model.")
                else k: v for k, v in tensors.items()}
    config = {**top, "text_config": text,
              "tie_word_embeddings": text["tie_word_embeddings"], "dtype": text["dtype"],
              "quantization": text.pop("quantization")}
    if "eos_token_id" in text:
        config["eos_token_id"] = text["eos_token_id"]
    return config, {**prefixed, **vision}


def image_token(out_dir: Path, mmproj: Path) -> int:
    """The id of the image placeholder in the model's tokenizer (written to out_dir)."""
    from tokenizers import Tokenizer

    from deltaserve.multimodal.processor import IMAGE_PAD

    token = Tokenizer.from_file(str(out_dir / "tokenizer.json")).token_to_id(IMAGE_PAD)
    if token is None:
        raise CheckpointError(f"the model's vocabulary has no {IMAGE_PAD}: {mmproj.name} cannot "
                              "be used with it")
    return int(token)
