"""GGUF (qwen35) files with F32/F16/BF16/Q8_0/Q4_0/Q1_0 tensors, imported and run.

The files are written with the `gguf` package's GGUFWriter and its reference quantizers (Q1_0, which
it cannot quantize yet, by hand from the published block layout), following llama.cpp's qwen35
conversion rules; nothing here uses our importer's code. The reference model holds the values the
file encodes (gguf's own dequantizer), in HF layout.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from deltaserve import LLM
from deltaserve.cache.sequence import prompt_logits
from deltaserve.checkpoint.default import default_model_dir
from deltaserve.cli import main
from deltaserve.errors import CheckpointError
from deltaserve.quant.gguf_import import import_gguf

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
RENAME = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "linear_attn.in_proj_qkv": "attn_qkv",
          "linear_attn.in_proj_z": "attn_gate", "linear_attn.in_proj_b": "ssm_beta",
          "linear_attn.in_proj_a": "ssm_alpha", "linear_attn.out_proj": "ssm_out",
          "linear_attn.norm": "ssm_norm", "linear_attn.conv1d": "ssm_conv1d"}
PLUS_ONE = ("attn_norm", "post_attention_norm", "attn_q_norm", "attn_k_norm")
PROMPT_IDS = [[5, 300, 41, 7, 900, 12, 1000, 77, 3]]


def q1_blocks(x: np.ndarray) -> np.ndarray:
    """Q1_0: per 128 weights, d = mean|x| (f16) then 16 bytes of sign bits, LSB first."""
    rows = x.shape[0]
    g = x.reshape(rows, -1, 128)
    d = np.abs(g).mean(-1).astype(np.float16)
    bits = np.packbits(g >= 0, axis=-1, bitorder="little")
    blocks = np.concatenate([d[..., None].view(np.uint8), bits], axis=-1)
    deq = d.astype(np.float32)[..., None] * np.where(g >= 0, 1.0, -1.0)
    return blocks.reshape(rows, -1), deq.reshape(x.shape).astype(np.float32)


def write_gguf(src, path, qtype, embed_qtype):
    """The default model as a qwen35 GGUF; returns {hf name: the values the file encodes}."""
    cfg = __import__("json").loads((src / "config.json").read_text())
    hf = load_file(str(src / "model.safetensors"))
    w = gguf.GGUFWriter(str(path), "qwen35")
    a = "qwen35."
    for key, val in (("block_count", 8), ("context_length", 8192), ("embedding_length", 384),
                     ("feed_forward_length", 896), ("attention.head_count", 6),
                     ("attention.head_count_kv", 2), ("attention.key_length", 64),
                     ("attention.value_length", 64), ("ssm.conv_kernel", 4), ("ssm.state_size", 64),
                     ("ssm.group_count", 6), ("ssm.time_step_rank", 6), ("ssm.inner_size", 384),
                     ("full_attention_interval", 4), ("rope.dimension_count", 16)):
        w.add_uint32(a + key, val)
    w.add_float32(a + "attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    w.add_float32(a + "rope.freq_base", float(cfg["rope_parameters"]["rope_theta"]))
    w.add_array(a + "rope.dimension_sections", [3, 3, 2, 0])
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    ref = {}
    for name, t in hf.items():
        if name.startswith("mtp."):
            continue
        x = t.float().numpy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            mod, leaf = rest.rsplit(".", 1)
            if mod == "linear_attn":
                gname = f"blk.{layer}." + {"A_log": "ssm_a", "dt_bias": "ssm_dt.bias"}[leaf]
            else:
                gname = f"blk.{layer}.{RENAME[mod]}.{leaf}"
        kind = embed_qtype if gname == "token_embd.weight" else qtype
        if x.ndim == 2 and kind != Q.F32:
            if kind == Q.Q1_0:
                blocks, deq = q1_blocks(x)
            else:
                blocks = gguf.quants.quantize(x, kind)
                deq = gguf.quants.dequantize(blocks, kind).reshape(x.shape)
            w.add_tensor(gname, blocks, raw_dtype=kind)
            ref[name] = torch.from_numpy(np.ascontiguousarray(deq))
            continue
        if gname.endswith("ssm_a"):
            x = -np.exp(x)
        elif gname.endswith("ssm_conv1d.weight"):
            x = x[:, 0, :]
        elif gname == "output_norm.weight" or gname.split(".")[2] in PLUS_ONE:
            x = x + 1.0
        w.add_tensor(gname, np.ascontiguousarray(x.astype(np.float32)))
        ref[name] = t.float()
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ref


@pytest.mark.parametrize(("qtype", "embed_qtype"), [("Q8_0", "Q8_0"), ("Q4_0", "Q8_0"),
                                                    ("Q1_0", "Q4_0"), ("F32", "BF16")])
def test_gguf_file_runs_like_the_values_it_encodes(tmp_path, qtype, embed_qtype) -> None:
    src = default_model_dir()
    ref = write_gguf(src, tmp_path / "m.gguf", Q[qtype], Q[embed_qtype])
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "imported", tokenizer_dir=src)
    assert out["tensors"] > 0
    ref_dir = tmp_path / "ref"
    shutil.copytree(src, ref_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(ref, str(ref_dir / "model.safetensors"))
    ours, theirs = LLM(tmp_path / "imported", dtype="float32"), LLM(ref_dir, dtype="float32")
    ids = torch.tensor(PROMPT_IDS)
    lo = prompt_logits(ours.model, ids)[None]
    lr = prompt_logits(theirs.model, ids)[None]
    assert ((lo - lr).norm() / lr.norm()).item() <= 1e-5


def test_bad_gguf_files_are_clear_errors(tmp_path, capsys) -> None:
    src = default_model_dir()
    write_gguf(src, tmp_path / "m.gguf", Q.Q8_0, Q.Q8_0)
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    assert main(["import-gguf", str(tmp_path / "cut.gguf"), str(tmp_path / "o1"),
                 "--tokenizer-from", str(src)]) == 1
    assert "cannot read GGUF file" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match="tokenizer"):
        import_gguf(tmp_path / "m.gguf", tmp_path / "o2")
    (tmp_path / "k").mkdir()
    write_gguf(src, tmp_path / "k" / "m.gguf", Q.Q5_0, Q.Q8_0)
    with pytest.raises(CheckpointError, match="type Q5_0; supported"):
        import_gguf(tmp_path / "k" / "m.gguf", tmp_path / "o3", tokenizer_dir=src)
