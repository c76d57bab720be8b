"""GGUF (llama.cpp, architecture `qwen35`) -> a deltaserve checkpoint folder.

Read with the `gguf` package; names and transforms are the inverse of llama.cpp's conversion
(formats.md section 6): (1+w) norms stored +1, `ssm_a` = -exp(A_log), conv stored [C, 4].
Q8_0 -> int8 (group 32), Q4_0 / Q4_1 -> 4-bit affine (group 32, bias -8d / m), Q1_0 -> q1 (group
128): the block bytes repacked; the K-quants, IQ4_XS / IQ4_NL and Q5_0 / Q5_1 are kept as the
file's blocks (quant/ggml_blocks.py). Nothing is dequantized: the values are exactly the file's.
Only 1-D tensors (norms, biases) and the conv are turned into floats, as llama.cpp keeps them.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from deltaserve.checkpoint.presets import text_config
from deltaserve.errors import CheckpointError
from deltaserve.progress import track
from deltaserve.quant.ggml_blocks import BLOCKS, GGUF_TYPES
from deltaserve.quant.gguf_read import read_gguf
from deltaserve.quant.gguf_tokenizer import tokenizer_files
from deltaserve.quant.schemes import Scheme, pack_codes

_RENAME = {
    "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight":
    "post_attention_layernorm.weight", "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight", "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight", "attn_gate.weight":
    "linear_attn.in_proj_z.weight", "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight", "ssm_conv1d.weight":
    "linear_attn.conv1d.weight", "ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_norm.weight": "linear_attn.norm.weight", "ssm_out.weight": "linear_attn.out_proj.weight",
}
_SHIFTED = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight",
            "k_norm.weight")
_SCHEMES = {"Q8_0": Scheme("int8", 8, 32), "Q4_0": Scheme("affine", 4, 32),
            "Q4_1": Scheme("affine", 4, 32), "Q1_0": Scheme("q1", 1, 128)}
_SCHEMES.update({t: Scheme(k, BLOCKS[k][3], BLOCKS[k][1]) for t, k in GGUF_TYPES.items()})
_FLOAT_TYPES = ("F32", "F16", "BF16")
_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q1_0": 18,
                **{t: BLOCKS[k][2] for t, k in GGUF_TYPES.items()}}


_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)


def split_parts(path: Path) -> list[Path]:
    """The files of a split set (`NAME-00001-of-00003.gguf`, any part given), or [path]."""
    match = _SPLIT.match(path.name)
    if match is None:
        return [path]
    count = int(match["count"])
    parts = [path.with_name(f"{match['stem']}-{i:05d}-of-{match['count']}.gguf")
             for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise CheckpointError(f"GGUF split set {path.name}: missing {', '.join(missing)}")
    return parts


_NEXTN = {"nextn.eh_proj.weight": "fc.weight", "nextn.enorm.weight":
          "pre_fc_norm_embedding.weight", "nextn.hnorm.weight": "pre_fc_norm_hidden.weight",
          "nextn.shared_head_norm.weight": "norm.weight"}


def hf_name(name: str, num_layers: int | None = None) -> str | None:
    """The HF name of a GGUF tensor; blocks from num_layers on are the MTP (nextn) layers
    (their own embedding and head copies, when present, are left: the model's are used)."""
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output.weight":
        return "lm_head.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    parts = name.split(".", 2)
    if parts[0] != "blk" or len(parts) != 3 or not parts[1].isdigit():
        return None
    layer = int(parts[1])
    if num_layers is not None and layer >= num_layers:
        mtp = f"mtp.layers.{layer - num_layers}"
        if parts[2] in _NEXTN:
            return f"mtp.{_NEXTN[parts[2]]}" if layer == num_layers else None
        return f"{mtp}.{_RENAME[parts[2]]}" if parts[2] in _RENAME else None
    return f"model.layers.{layer}.{_RENAME[parts[2]]}" if parts[2] in _RENAME else None


def gguf_name(name: str, num_layers: int) -> str:
    """The GGUF name llama.cpp's converter gives HF tensor `name` (the inverse of hf_name; the
    MTP block goes after the model's num_layers blocks)."""
    if name in _TO_GGUF_FIXED:
        return _TO_GGUF_FIXED[name]
    if name in _TO_NEXTN:
        return f"blk.{num_layers}.{_TO_NEXTN[name]}"
    if name.startswith("mtp.layers."):
        index, rest = name.removeprefix("mtp.layers.").split(".", 1)
        return f"blk.{num_layers + int(index)}.{_TO_GGUF[rest]}"
    layer, rest = name.removeprefix("model.layers.").split(".", 1)
    return f"blk.{layer}.{_TO_GGUF[rest]}"


_TO_GGUF_FIXED = {"model.embed_tokens.weight": "token_embd.weight",
                  "lm_head.weight": "output.weight", "model.norm.weight": "output_norm.weight"}
_TO_NEXTN = {f"mtp.{v}": k for k, v in _NEXTN.items()}
_TO_GGUF = {v: k for k, v in _RENAME.items()}


def stored_plus_one(name: str) -> bool:
    """A (1 + w) norm of HF tensor `name`: GGUF stores it with the 1 added."""
    return name.endswith(_SHIFTED) or name in ("model.norm.weight", "mtp.norm.weight") or \
        name.startswith("mtp.pre_fc_norm_")


def import_gguf(path: Path, out_dir: Path, tokenizer_dir: Path | None = None,
                dequantize: bool = False, mmproj: Path | None = None) -> dict:
    """The checkpoint folder of a GGUF file (or split set); dequantize: every tensor as fp32
    through the gguf package's dequantizer (a float checkpoint transformers can load: the
    reference the quantized import is checked against). mmproj: MiniCPM-V-4.6's vision file
    (quant/gguf_mmproj): the folder is then that model's, the text under model.language_model."""
    try:
        import gguf  # noqa: F401 (the tensor types and dequantizers are its)
    except ImportError as exc:
        raise CheckpointError("reading GGUF needs the gguf package: pip install 'deltaserve[gguf]'") from exc
    readers = []
    for part in split_parts(path):
        try:
            readers.append(read_gguf(part))
        except (ValueError, struct.error, OSError) as exc:
            raise CheckpointError(f"cannot read GGUF file {part}: {exc}") from exc
    meta = readers[0].meta
    if int(meta.get("split.count", 1) or 1) != len(readers):
        raise CheckpointError(f"GGUF {path} says it is one of {meta.get('split.count')} parts, "
                              f"but {len(readers)} were found")
    arch = meta.get("general.architecture")
    if arch != "qwen35":
        raise CheckpointError(f"GGUF architecture '{arch}' is not supported (only qwen35)")
    embedded = None
    if tokenizer_dir is None and "tokenizer.ggml.model" in meta:
        embedded = tokenizer_files(meta)  # the file's own (checked before any tensor is read)
    tok_src = tokenizer_dir or path.parent
    if embedded is None and not (tok_src / "tokenizer.json").is_file():
        raise CheckpointError(f"{path.name} carries no tokenizer and there is no tokenizer.json "
                              f"in {tok_src}: put the original model's tokenizer.json beside it, "
                              "or import it with `deltaserve import-gguf FILE OUT "
                              "--tokenizer-from FOLDER`")
    config = _config(meta, readers)
    tensors, schemes = _tensors(readers, config, dequantize)
    config["quantization"] = _block(schemes)
    config["dtype"] = _dtype(readers, config, dequantize)
    if mmproj is not None:
        from deltaserve.quant.gguf_mmproj import with_vision

        config, tensors = with_vision(config, tensors, mmproj)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    if embedded is not None:
        _write_tokenizer(embedded, out_dir)
    else:
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                     "generation_config.json"):
            if (tok_src / name).is_file():
                shutil.copy(tok_src / name, out_dir / name)
    if mmproj is not None:
        from deltaserve.quant.gguf_mmproj import image_token

        config["image_token_id"] = image_token(out_dir, mmproj)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    types = Counter(t.tensor_type.name for r in readers for t in r.tensors)
    return {"tensors": len(tensors), "quantized": len(schemes), "out": str(out_dir),
            "tokenizer": "embedded" if embedded is not None else str(tok_src),
            "types": dict(sorted(types.items()))}


def _write_tokenizer(files: dict, out_dir: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out_dir / name).write_text(json.dumps(files[name], ensure_ascii=False), encoding="utf-8")
    if files["chat_template.jinja"]:
        (out_dir / "chat_template.jinja").write_text(files["chat_template.jinja"],
                                                     encoding="utf-8")
    if files["eos_ids"]:
        (out_dir / "generation_config.json").write_text(
            json.dumps({"eos_token_id": files["eos_ids"]}), encoding="utf-8")


def _config(meta: dict, readers) -> dict:
    def get(key, default=None):
        value = meta.get(f"qwen35.{key}", default)
        if value is None:
            raise CheckpointError(f"GGUF metadata lacks qwen35.{key}")
        return value

    layers = int(get("block_count")) - int(meta.get("qwen35.nextn_predict_layers", 0) or 0)
    num_v, num_k = int(get("ssm.time_step_rank")), int(get("ssm.group_count"))
    if num_v % num_k:
        raise CheckpointError(f"GGUF linear attention has {num_v} value heads for {num_k} key "
                              "heads (must be a multiple)")
    head_dim = int(get("attention.key_length"))
    all_tensors = [t for r in readers for t in r.tensors]
    names = {t.name for t in all_tensors}
    if "token_embd.weight" not in names:
        raise CheckpointError("GGUF file has no token_embd.weight (a missing part of a split set?)")
    embd = next(t for t in all_tensors if t.name == "token_embd.weight")
    cfg = text_config(int(get("embedding_length")), int(get("feed_forward_length")), layers,
                      int(get("attention.head_count")), int(get("attention.head_count_kv")),
                      num_k, num_v, "output.weight" not in names)
    cfg.update(
        architectures=["Qwen3_5ForCausalLM"], head_dim=head_dim,
        linear_key_head_dim=int(get("ssm.state_size")),
        linear_value_head_dim=int(get("ssm.inner_size")) // num_v,
        linear_conv_kernel_dim=int(get("ssm.conv_kernel")),
        max_position_embeddings=int(get("context_length")),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        vocab_size=int(embd.shape[-1]), full_attention_interval=int(get("full_attention_interval")),
        mtp_num_hidden_layers=int(meta.get("qwen35.nextn_predict_layers", 0) or 0),
    )
    cfg["layer_types"] = ["full_attention" if (i + 1) % cfg["full_attention_interval"] == 0
                          else "linear_attention" for i in range(layers)]
    eos = meta.get("tokenizer.ggml.eos_token_id")
    if eos is not None:
        cfg["eos_token_id"] = int(eos)
    rope = cfg["rope_parameters"]
    rope["rope_theta"] = float(get("rope.freq_base"))
    rope["partial_rotary_factor"] = int(get("rope.dimension_count")) / head_dim
    rope["mrope_section"] = [int(x) for x in list(get("rope.dimension_sections"))[:3]]
    return cfg


def _tensors(readers, cfg: dict, dequantize: bool = False
             ) -> tuple[dict[str, torch.Tensor], dict[str, Scheme]]:
    tensors, schemes = {}, {}
    every = [t for r in readers for t in r.tensors]
    for t in track(every, "importing GGUF", unit="tensor"):
        name = hf_name(t.name, cfg["num_hidden_layers"])
        if name is None:
            continue  # unknown extras, the MTP block's own embedding / head copies
        qtype = t.tensor_type.name
        order = _value_head_order(name, cfg)
        if qtype in _FLOAT_TYPES or (qtype in _SCHEMES and (dequantize or not _is_matrix(name))):
            x = _float(t, name)
            if order is not None:
                axis, perm = order
                x = x.index_select(axis, torch.from_numpy(perm(x.shape[axis], 1)))
            tensors[name] = x.contiguous()
        elif qtype in _SCHEMES:
            base = name.removesuffix(".weight")
            schemes[base] = _SCHEMES[qtype]
            for leaf, v in _repack(t, qtype, order).items():
                tensors[f"{base}.{leaf}"] = v
        else:
            raise CheckpointError(
                f"GGUF tensor '{t.name}' has type {qtype}; supported: "
                f"{', '.join(_FLOAT_TYPES + tuple(_SCHEMES))}"
            )
    return tensors, schemes


def _dtype(readers, cfg: dict, dequantize: bool) -> str:
    """What `--dtype auto` loads: the file's own float type of its largest float matrix; float32
    where every matrix is quantized (the vectors left are F32 in the file, and llama.cpp computes
    them in F32 too: narrowing them cost both accuracy and, on CPU, casts per op) and for a
    dequantized import (its values are the dequantizer's fp32)."""
    floats = [(int(np.prod(t.shape)), t.tensor_type.name) for r in readers for t in r.tensors
              if t.tensor_type.name in _FLOAT_TYPES
              and _is_matrix(hf_name(t.name, cfg["num_hidden_layers"]) or "")]
    if dequantize or not floats:
        return "float32"
    return {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}[max(floats)[1]]


def _is_matrix(name: str) -> bool:
    """A tensor the engine holds as a (possibly quantized) matrix: a Linear or the embedding."""
    return name.endswith(".weight") and not name.endswith(("norm.weight", "conv1d.weight"))


def _q1_0_floats(raw: np.ndarray) -> np.ndarray:
    """Q1_0 blocks (fp16 d, 16 bytes of bits, lowest bit first) -> fp32: bit ? d : -d, as
    llama.cpp's dequantize_row_q1_0. raw uint8 [..., blocks * 18] -> [..., blocks * 128]."""
    blocks = raw.reshape(*raw.shape[:-1], -1, 18)
    d = blocks[..., :2].copy().view(np.float16).astype(np.float32)  # [..., blocks, 1]
    bits = np.unpackbits(blocks[..., 2:], axis=-1, bitorder="little").astype(np.float32)
    return (d * (2 * bits - 1)).reshape(*raw.shape[:-1], -1)


def _float(t, name: str) -> torch.Tensor:
    data = np.asarray(t.data)
    if t.tensor_type.name not in _FLOAT_TYPES:  # a quantized vector or conv: read as floats
        import gguf

        try:
            if t.tensor_type.name == "Q1_0":  # newer than the gguf package's dequantizers
                data = _q1_0_floats(data)
            else:
                data = gguf.quants.dequantize(data, t.tensor_type)
        except ValueError as exc:  # a block count that does not fit the shape
            raise CheckpointError(f"GGUF tensor '{t.name}' is truncated or mis-sized") from exc
        except NotImplementedError as exc:
            raise CheckpointError(f"the gguf package has no dequantizer for {t.tensor_type.name} "
                                  f"(tensor '{t.name}')") from exc
    if t.tensor_type.name == "BF16":
        x = torch.from_numpy(data.copy().view(np.int16)).view(torch.bfloat16).float()
    else:
        x = torch.from_numpy(data.astype(np.float32))
    x = x.reshape([int(d) for d in reversed(list(t.shape))])
    if name.endswith("conv1d.weight"):
        return x.reshape(x.shape[0], 1, -1).contiguous()
    if name.endswith("A_log"):
        return torch.log(-x.double()).float()
    if stored_plus_one(name):
        return x - 1.0
    return x.contiguous()


def _value_head_order(name: str, cfg: dict):
    """For a GDN tensor of a model with more value heads than key heads: (axis, perm) where
    perm(n, unit) gives the HF order of that axis's n entries (unit: entries per index, for
    quantized blocks). llama.cpp's converter (conversion/qwen.py, _reorder_v_heads) stores the
    value heads tiled, GGUF slot i*Hk + g holding HF head g*r + i (r = Hv / Hk), so that ggml's
    repeat of the key heads lines up; this undoes it."""
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    if hk == hv or ".linear_attn." not in name:
        return None
    r, dk, dv = hv // hk, cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    leaf = name.split(".linear_attn.", 1)[1]
    axis, start, hd = {
        "in_proj_qkv.weight": (0, 2 * hk * dk, dv), "conv1d.weight": (0, 2 * hk * dk, dv),
        "in_proj_z.weight": (0, 0, dv), "in_proj_b.weight": (0, 0, 1),
        "in_proj_a.weight": (0, 0, 1), "A_log": (0, 0, 1), "dt_bias": (0, 0, 1),
        "out_proj.weight": (1, 0, dv)}.get(leaf, (None, 0, 0))
    if axis is None:
        return None

    def perm(n: int, unit: int) -> np.ndarray:
        if start % unit or hd % unit:
            raise CheckpointError(f"GGUF tensor for '{name}': its value heads ({hd} wide) do not "
                                  f"fall on whole quantization blocks ({unit}), so their order "
                                  "cannot be undone")
        index = np.arange(n // unit)
        a, width = start // unit, hv * hd // unit
        index[a:a + width] = index[a:a + width].reshape(r, hk, -1).transpose(1, 0, 2).ravel()
        return index

    return axis, perm


def _repack(t, qtype: str, order=None) -> dict[str, torch.Tensor]:
    cols, rows = int(t.shape[0]), int(np.prod([int(d) for d in t.shape[1:]]))
    raw = np.asarray(t.data, dtype=np.uint8).reshape(rows, -1)
    block = _BLOCK_BYTES[qtype]
    if raw.shape[1] * (_SCHEMES[qtype].group_size) != cols * block:
        raise CheckpointError(f"GGUF tensor '{t.name}' is truncated or mis-sized")
    blocks = raw.reshape(rows, -1, block)
    extra = {}
    if order is not None:  # whole rows, or whole blocks along a row
        axis, perm = order
        unit = 1 if axis == 0 else _SCHEMES[qtype].group_size
        if axis == 1 and not _whole_blocks(perm, cols, unit):
            # value heads narrower than a block (dv 128 in 256-wide K-quant blocks): the columns
            # stay in the file's order and the input is gathered into it (Linear.input_order)
            extra["input_order"] = torch.from_numpy(np.argsort(perm(cols, 1)).astype(np.int64))
        else:
            blocks = np.take(blocks, perm(rows if axis == 0 else cols, unit), axis=axis)
    scheme = _SCHEMES[qtype]
    out = _repack_blocks(blocks, scheme, qtype, rows, cols)
    return {**out, **extra}


def _whole_blocks(perm, cols: int, unit: int) -> bool:
    try:
        perm(cols, unit)
    except CheckpointError:
        return False
    return True


def _repack_blocks(blocks: np.ndarray, scheme: Scheme, qtype: str, rows: int, cols: int
                   ) -> dict[str, torch.Tensor]:
    if scheme.is_block():
        return {"weight": torch.from_numpy(blocks.reshape(rows, -1).copy())}
    d = torch.from_numpy(blocks[:, :, :2].copy().view(np.float16)[..., 0])
    if qtype == "Q4_1":  # d, m, 16 bytes of nibbles (elements 0-15 low, 16-31 high)
        m = torch.from_numpy(blocks[:, :, 2:4].copy().view(np.float16)[..., 0])
        qs = blocks[:, :, 4:]
        codes = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(rows, cols)
        return {"weight": pack_codes(torch.from_numpy(codes.astype(np.int64)), 4), "scales": d,
                "biases": m}
    qs = blocks[:, :, 2:]
    if qtype == "Q8_0":
        return {"weight": torch.from_numpy(qs.copy().view(np.int8).reshape(rows, cols)), "scales": d}
    if qtype == "Q1_0":
        return {"weight": torch.from_numpy(qs.reshape(rows, cols // 8).copy()), "scales": d}
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(rows, cols)  # Q4_0 nibble order
    return {"weight": pack_codes(torch.from_numpy(codes.astype(np.int64)), 4), "scales": d,
            "biases": (d.float() * -8.0).half()}


def _block(schemes: dict[str, Scheme]) -> dict:
    if not schemes:
        return {}
    main = Counter(s for s in schemes.values() if not s.is_block()).most_common(1)
    main = main[0][0] if main else Scheme("int8", 8, 32)  # (only a default: every module is named)
    block = {"format": "gguf-import", "kind": main.kind, "bits": main.bits,
             "group_size": main.group_size}
    for name, s in schemes.items():
        if s != main or s.is_block():  # block kinds always by name (quant/loading._named_block)
            block[name] = {"kind": s.kind, "bits": s.bits, "group_size": s.group_size}
    return block
