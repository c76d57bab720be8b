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

from deltaserve import LLM, SamplingParams
from deltaserve.cache.sequence import prompt_logits
from deltaserve.checkpoint.default import default_model_dir
from deltaserve.cli import main
from deltaserve.errors import CheckpointError
from deltaserve.quant.gguf_import import import_gguf
from deltaserve.quant.linear import packed
from deltaserve.quant.loading import module_checkpoint_names
from deltaserve.quant.schemes import dequantize

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


# where each type's fp16 fields sit in its block (ggml-common.h): random bytes elsewhere are valid
RANDOM_BLOCKS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
                 "IQ4_NL": (0,), "IQ4_XS": (0,)}


def random_blocks(rows: int, nbytes: int, qtype: str, seed: int) -> np.ndarray:
    """Rows of random blocks of a type, its fp16 scales small and finite."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, nbytes), dtype=np.uint8)
    size = gguf.GGML_QUANT_SIZES[Q[qtype]][1]
    blocks = raw.reshape(rows, -1, size)
    for at in RANDOM_BLOCKS[qtype]:
        scale = (rng.uniform(0.002, 0.02, blocks.shape[:2]) * rng.choice([-1, 1], blocks.shape[:2]))
        blocks[:, :, at:at + 2] = scale.astype(np.float16)[..., None].view(np.uint8)
    return raw


def tiled(x: np.ndarray, axis: int, start: int, hk: int, r: int, hd: int) -> np.ndarray:
    """llama.cpp's converter order for value heads (conversion/qwen.py, _reorder_v_heads): HF
    head g*r + i goes to slot i*Hk + g, each head a block of hd entries along axis."""
    x = np.moveaxis(x, axis, 0).copy()
    seg = x[start:start + hk * r * hd]
    x[start:start + hk * r * hd] = seg.reshape(hk, r, hd, *seg.shape[1:]).swapaxes(0, 1) \
        .reshape(seg.shape)
    return np.moveaxis(x, 0, axis)


def untiled(x: np.ndarray, axis: int, start: int, hk: int, r: int, hd: int) -> np.ndarray:
    x = np.moveaxis(x, axis, 0).copy()
    seg = x[start:start + hk * r * hd]
    x[start:start + hk * r * hd] = seg.reshape(r, hk, hd, *seg.shape[1:]).swapaxes(0, 1) \
        .reshape(seg.shape)
    return np.moveaxis(x, 0, axis)


def head_order(name: str, cfg: dict):
    """(axis, start, Hk, r, head width) of a GDN tensor whose value heads the converter tiles."""
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    if hk == hv or ".linear_attn." not in name:
        return None
    qk, dv = 2 * hk * cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    spec = {"in_proj_qkv.weight": (0, qk, dv), "conv1d.weight": (0, qk, dv),
            "in_proj_z.weight": (0, 0, dv), "in_proj_b.weight": (0, 0, 1),
            "in_proj_a.weight": (0, 0, 1), "A_log": (0, 0, 1), "dt_bias": (0, 0, 1),
            "out_proj.weight": (1, 0, dv)}.get(name.split(".linear_attn.")[1])
    return None if spec is None else (spec[0], spec[1], hk, hv // hk, spec[2])


def write_gguf(src, path, qtype, embed_qtype, split_max_tensors: int = 0, extra=None):
    """A checkpoint folder as a qwen35 GGUF by llama.cpp's conversion rules (a split set of files
    of at most split_max_tensors tensors each, if given; extra(writer) adds keys; qtype may be a
    function of the GGUF tensor name); returns
    {hf name: the values the file encodes, in HF layout}."""
    cfg = __import__("json").loads((src / "config.json").read_text())
    hf = load_file(str(src / "model.safetensors"))
    w = gguf.GGUFWriter(str(path), "qwen35", split_max_tensors=split_max_tensors)
    a = "qwen35."
    hv, dv = cfg["linear_num_value_heads"], cfg["linear_value_head_dim"]
    rope = cfg["rope_parameters"]
    layers, mtp = cfg["num_hidden_layers"], cfg.get("mtp_num_hidden_layers", 0)
    for key, val in (("block_count", layers + mtp), ("nextn_predict_layers", mtp),
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
    w.add_float32(a + "attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    w.add_float32(a + "rope.freq_base", float(rope["rope_theta"]))
    w.add_array(a + "rope.dimension_sections", [*rope["mrope_section"], 0])
    if extra is not None:
        extra(w)
    else:
        w.add_uint32("tokenizer.ggml.eos_token_id", cfg["eos_token_id"])
    ref = {}
    for name, t in hf.items():
        x = t.float().numpy()
        order = head_order(name, cfg)
        if order is not None:
            x = tiled(x, *order)
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name.startswith("mtp.") and not name.startswith("mtp.layers."):  # nextn extras
            gname = f"blk.{layers}.nextn." + {
                "fc.weight": "eh_proj.weight", "pre_fc_norm_embedding.weight": "enorm.weight",
                "pre_fc_norm_hidden.weight": "hnorm.weight",
                "norm.weight": "shared_head_norm.weight"}[name.removeprefix("mtp.")]
            if "norm" in gname:
                x = x + 1.0
        else:
            if name.startswith("mtp.layers."):  # the MTP block follows the model's blocks
                index, rest = name.removeprefix("mtp.layers.").split(".", 1)
                name_in_model = f"model.layers.{layers + int(index)}.{rest}"
            else:
                name_in_model = name
            layer, rest = name_in_model.removeprefix("model.layers.").split(".", 1)
            mod, leaf = rest.rsplit(".", 1)
            if mod == "linear_attn":
                gname = f"blk.{layer}." + {"A_log": "ssm_a", "dt_bias": "ssm_dt.bias"}[leaf]
            else:
                gname = f"blk.{layer}.{RENAME[mod]}.{leaf}"
        kind = embed_qtype if gname == "token_embd.weight" else qtype
        kind = kind(gname) if callable(kind) else kind  # a per-tensor mix, as Q4_K_M files are
        block, size = gguf.GGML_QUANT_SIZES[kind]
        if x.ndim == 2 and x.shape[1] % block:
            kind = Q.F32  # as llama-quantize falls back for rows its blocks do not fill
        if x.ndim == 2 and kind != Q.F32:
            if kind == Q.Q1_0:
                blocks, deq = q1_blocks(x)
            elif kind.name in RANDOM_BLOCKS:  # gguf-py cannot quantize these: random blocks
                blocks = random_blocks(x.shape[0], x.shape[1] // block * size, kind.name,
                                       seed=len(ref))
                deq = gguf.quants.dequantize(blocks, kind).reshape(x.shape)
            else:
                blocks = gguf.quants.quantize(x, kind)
                deq = gguf.quants.dequantize(blocks, kind).reshape(x.shape)
            w.add_tensor(gname, blocks, raw_dtype=kind)
            if order is not None:
                deq = untiled(deq, *order)
            ref[name] = torch.from_numpy(np.ascontiguousarray(deq))
            continue
        if gname.endswith("ssm_a"):
            x = -np.exp(x)
        elif gname.endswith("ssm_conv1d.weight"):
            x = x[:, 0, :]
        elif gname == "output_norm.weight" or gname.split(".")[2:3] in [[p] for p in PLUS_ONE]:
            x = x + 1.0
        w.add_tensor(gname, np.ascontiguousarray(x.astype(np.float32)))
        ref[name] = t.float()
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ref


@pytest.fixture(autouse=True)
def exact_activations(monkeypatch):
    """The file's values are checked through the exact kernels (fp32 activations); the
    int8-activation block kernels have their own tests (tests/ops/test_blocks.py) and one
    model-level bound below."""
    monkeypatch.setenv("DELTASERVE_EXACT_INT8_ACT", "1")


def logits_rel(src, ref: dict, imported, tmp_path) -> float:
    """Prompt logits rel-L2 of the imported folder against a copy of src holding ref's values."""
    ref_dir = tmp_path / "ref"
    shutil.copytree(src, ref_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(ref, str(ref_dir / "model.safetensors"))
    ours, theirs = LLM(imported, dtype="float32"), LLM(ref_dir, dtype="float32")
    ids = torch.tensor(PROMPT_IDS)
    lo, lr = prompt_logits(ours.model, ids), prompt_logits(theirs.model, ids)
    return ((lo - lr).norm() / lr.norm()).item()


@pytest.mark.parametrize(("qtype", "embed_qtype"), [("Q8_0", "Q8_0"), ("Q4_0", "Q8_0"),
                                                    ("Q1_0", "Q4_0"), ("F32", "BF16")])
def test_gguf_file_runs_like_the_values_it_encodes(tmp_path, qtype, embed_qtype) -> None:
    src = default_model_dir()
    ref = write_gguf(src, tmp_path / "m.gguf", Q[qtype], Q[embed_qtype])
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "imported", tokenizer_dir=src)
    assert out["tensors"] > 0
    assert logits_rel(src, ref, tmp_path / "imported", tmp_path) <= 1e-5


@pytest.mark.parametrize("qtype", ["Q1_0", "Q4_K"])
def test_the_dequantized_import_holds_the_files_values(tmp_path, qtype) -> None:
    """import-gguf --dequantize (the reference side of scripts/gguf/quantize_check.py): every
    tensor fp32, Q1_0 through llama.cpp's rule (the gguf package has no dequantizer for it)."""
    src = default_model_dir()
    ref = write_gguf(src, tmp_path / "m.gguf", Q[qtype], Q.Q8_0)
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "imported", tokenizer_dir=src,
                      dequantize=True)
    assert out["quantized"] == 0
    assert logits_rel(src, ref, tmp_path / "imported", tmp_path) <= 1e-5


@pytest.mark.parametrize(("qtype", "embed_qtype", "dequant", "want"),
                         [("Q4_0", "Q8_0", False, "float32"), ("F32", "BF16", False, "bfloat16"),
                          ("BF16", "BF16", False, "bfloat16"), ("BF16", "F32", False, "float32"),
                          ("Q4_K", "Q8_0", True, "float32")])
def test_auto_dtype_is_the_files_own(tmp_path, qtype, embed_qtype, dequant, want) -> None:
    """--dtype auto loads what the file holds: its largest float matrix's type (the embedding
    here); float32 where every matrix is quantized (the norms and GDN vectors left are F32 in the
    file) and for a dequantized import."""
    from deltaserve.checkpoint.loader import resolve_dtype
    from deltaserve.checkpoint.reader import read_config

    src = default_model_dir()
    write_gguf(src, tmp_path / "m.gguf", Q[qtype], Q[embed_qtype])
    import_gguf(tmp_path / "m.gguf", tmp_path / "imported", tokenizer_dir=src, dequantize=dequant)
    assert resolve_dtype("auto", read_config(tmp_path / "imported")) == getattr(torch, want)
    if want == "float32":
        llm = LLM(tmp_path / "imported")
        norms = [p for n, p in llm.model.named_parameters() if n.endswith("norm.weight")]
        assert norms and all(p.dtype == torch.float32 for p in norms)


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
    write_gguf(src, tmp_path / "k" / "m.gguf", Q.MXFP4, Q.Q8_0)
    with pytest.raises(CheckpointError, match="type MXFP4; supported"):
        import_gguf(tmp_path / "k" / "m.gguf", tmp_path / "o3", tokenizer_dir=src)


def test_the_model_may_be_a_gguf_file_or_a_split_set(tmp_path, capsys) -> None:
    """--model FILE.gguf (any part of a split set): imported once into the cache folder, then
    loaded from there; the split set gives the single file's logits; a missing part is named."""
    src = default_model_dir()
    for sub, split in (("one", 0), ("split", 25)):
        (tmp_path / sub).mkdir()
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(src / name, tmp_path / sub / name)
        write_gguf(src, tmp_path / sub / "m.gguf", Q.Q8_0, Q.Q8_0, split)
    parts = sorted((tmp_path / "split").glob("m-*-of-*.gguf"))
    assert len(parts) > 2
    one = LLM(tmp_path / "one" / "m.gguf", dtype="float32")
    assert "importing" in capsys.readouterr().err
    LLM(tmp_path / "one" / "m.gguf", dtype="float32")
    assert "importing" not in capsys.readouterr().err  # the cached copy
    split = LLM(parts[1], dtype="float32")
    ids = torch.tensor(PROMPT_IDS)
    assert torch.equal(prompt_logits(one.model, ids), prompt_logits(split.model, ids))
    parts[-1].unlink()
    with pytest.raises(CheckpointError, match=f"missing {parts[-1].name}"):
        LLM(parts[0], dtype="float32")


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_more_value_heads_than_key_heads_untied_head(tmp_path, qtype) -> None:
    """Hv = 3 Hk (as the 27B) with an untied head: the converter's value-head order is undone,
    so the model runs the values the file encodes (rows of qkv / z / b / a, conv channels, the
    per-head A and dt, out_proj's column blocks)."""
    from tests.conftest import write_variant

    src = write_variant(tmp_path / "hf", 4, linear_num_value_heads=6, tie_word_embeddings=False,
                        vocab_size=4096)
    ref = write_gguf(src, tmp_path / "m.gguf", Q[qtype], Q[qtype])
    import_gguf(tmp_path / "m.gguf", tmp_path / "imported", tokenizer_dir=src)
    assert logits_rel(src, ref, tmp_path / "imported", tmp_path) <= 1e-5
    imported = load_file(str(tmp_path / "imported" / "model.safetensors"))
    mtp = [name for name in ref if name.startswith("mtp.") and name in imported]
    assert len(mtp) == len([n for n in ref if n.startswith("mtp.")]) > 5  # the MTP block, whole
    assert all(torch.equal(imported[n].float(), ref[n].float()) for n in mtp
               if ref[n].ndim < 2 or qtype == "F32")


@pytest.mark.parametrize("qtype", ["Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                                   "IQ4_NL", "IQ4_XS"])
def test_every_type_is_held_quantized_with_the_files_values(tmp_path, qtype) -> None:
    """Each type is kept quantized (Q4_1 repacked into 4-bit affine, the rest as the file's own
    blocks): every weight it decodes to is exactly the gguf package's dequantized value (Hv = 2
    Hk, so the head order applies to the blocks too), the model's weights take about the file's
    bytes, and its logits match the reference's."""
    from tests.conftest import write_variant

    src = write_variant(tmp_path / "hf", 5, hidden_size=256, intermediate_size=512,
                        vocab_size=1024)
    ref = write_gguf(src, tmp_path / "m.gguf", Q[qtype], Q[qtype])
    report = import_gguf(tmp_path / "m.gguf", tmp_path / "imported", tokenizer_dir=src)
    assert report["types"][qtype] > 10
    llm = LLM(tmp_path / "imported", dtype="float32")
    checked = 0
    for module, names in module_checkpoint_names(llm.model):
        parts = getattr(module, "segments", None) or [module]
        if getattr(parts[0], "scheme", None) is None:
            continue
        got = torch.cat([dequantize(packed(p), p.scheme) for p in parts])
        want = torch.cat([ref[f"{n}.weight"].float() for n in names])
        assert torch.equal(got, want), names
        assert (parts[0].scheme.kind == "affine") == (qtype == "Q4_1")
        checked += 1
    assert checked >= 5 * 4
    held = sum(t.numel() * t.element_size() for t in llm.model.state_dict().values()
               if t.dtype in (torch.uint8, torch.uint32, torch.float16))
    assert held <= 1.10 * (tmp_path / "m.gguf").stat().st_size
    # the values are equal (above); what remains is fp32 summation order (the block GEMM's two
    # accumulators against MKL's) through six random layers: ~1e-5, where a wrong value is ~1e-2
    assert logits_rel(src, ref, tmp_path / "imported", tmp_path) <= 3e-5


def q4_k_m_like(gname: str):
    """A per-tensor mix as llama-quantize's Q4_K_M writes (v and down in Q6_K, the rest Q4_K),
    with one part of the packed GDN in-projection left F32."""
    if gname.endswith(("attn_v.weight", "ffn_down.weight")):
        return Q.Q6_K
    return Q.F32 if gname.endswith("ssm_alpha.weight") else Q.Q4_K


def test_a_mix_of_types_and_heads_narrower_than_blocks(tmp_path, monkeypatch) -> None:
    """A Q4_K_M-like mix on a model whose value heads (128 wide, Hv = 2 Hk) are narrower than a
    K-quant block: packed Linears whose parts differ run one Linear per part, the GDN out-projection
    keeps the file's column order and gathers its input into it; logits as the reference's."""
    from tests.conftest import write_variant

    src = write_variant(tmp_path / "hf", 6, hidden_size=256, intermediate_size=512,
                        vocab_size=1024, linear_value_head_dim=128, linear_key_head_dim=64)
    ref = write_gguf(src, tmp_path / "m.gguf", q4_k_m_like, Q.Q4_K)
    import_gguf(tmp_path / "m.gguf", tmp_path / "imported", tokenizer_dir=src)
    llm = LLM(tmp_path / "imported", dtype="float32")
    layer = llm.model.model.layers[0].linear_attn
    assert layer.out_proj.input_order is not None and layer.out_proj.scheme.kind == "q4_k"
    assert [getattr(p, "scheme", None) and p.scheme.kind for p in layer.in_proj.segments] == \
        ["q4_k", "q4_k", "q4_k", None]
    attn = llm.model.model.layers[3].self_attn
    assert [p.scheme.kind for p in attn.qkv_proj.segments] == ["q4_k", "q4_k", "q6_k"]
    assert logits_rel(src, ref, tmp_path / "imported", tmp_path) <= 1e-5
    # decoding through the engine (the layered path: the one-call decode step leaves blocks to
    # it), one sequence and two, gives the reference's greedy tokens
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [PROMPT_IDS[0], PROMPT_IDS[0][:5]]
    want = [o.outputs[0].token_ids for o in LLM(tmp_path / "ref", dtype="float32").generate(
        prompts, params)]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    assert llm.generate([PROMPT_IDS[0]], params)[0].outputs[0].token_ids == want[0]
    # int8 activations where this build has them (VNNI): the rounding of x shows, boundedly
    monkeypatch.setenv("DELTASERVE_EXACT_INT8_ACT", "0")
    assert logits_rel(src, ref, tmp_path / "imported", tmp_path / "int8") <= 0.05


def test_the_direct_reader_equals_the_gguf_packages(tmp_path) -> None:
    """quant/gguf_read against gguf.GGUFReader on one file: every metadata value (strings,
    string and number arrays, every scalar type) and every tensor's type, shape and bytes."""
    from deltaserve.quant.gguf_read import read_gguf

    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "qwen35")
    w.add_array("t.tokens", ["a", "Ġb", "中文", "", "<|im_end|>"] * 50)
    w.add_array("t.types", [1, 3, 1, 4, 1] * 50)
    w.add_array("t.scores", [0.5, -1.25])
    w.add_uint32("t.u32", 7)
    w.add_int64("t.i64", -3)
    w.add_float32("t.f32", 1.5)
    w.add_float64("t.f64", 2.25)
    w.add_bool("t.flag", True)
    w.add_string("t.text", "{% for m in messages %}{{ m }}{% endfor %}")
    rng = np.random.default_rng(0)
    w.add_tensor("a", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("b", rng.standard_normal((5, 32)).astype(np.float16))
    w.add_tensor("c", gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32),
                                           Q.Q8_0), raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, theirs = read_gguf(tmp_path / "m.gguf"), gguf.GGUFReader(str(tmp_path / "m.gguf"))
    for key, field in theirs.fields.items():
        if not key.startswith("GGUF."):
            assert ours.meta[key] == field.contents(), key
    assert len(ours.tensors) == len(theirs.tensors) == 3
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type, a.shape) == (b.name, b.tensor_type, tuple(map(int, b.shape)))
        assert np.asarray(a.data).tobytes() == np.asarray(b.data).tobytes()


@pytest.mark.gpu
@pytest.mark.parametrize("mix", ["Q4_K_M", "Q5_K", "Q6_K", "IQ4_XS", "Q8_0"])
def test_block_files_on_cuda_give_the_cpu_engines_tokens(tmp_path, mix) -> None:
    """A GGUF of each block type the Triton GEMVs read (and Q4_K_M's mix, value heads narrower
    than blocks) on CUDA in fp32 (block GEMVs in decode, under CUDA graphs; the dequantized GEMM
    in prefill) against the CPU engine's exact kernels: logits and greedy tokens, batched too."""
    from tests.conftest import write_variant

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    src = write_variant(tmp_path / "hf", 6, hidden_size=256, intermediate_size=512,
                        vocab_size=1024, linear_value_head_dim=128, linear_key_head_dim=64)
    qtype, embed = (q4_k_m_like, Q.Q6_K) if mix == "Q4_K_M" else (Q[mix], Q[mix])
    write_gguf(src, tmp_path / "m.gguf", qtype, embed)
    import_gguf(tmp_path / "m.gguf", tmp_path / "imported", tokenizer_dir=src)
    engines = {d: LLM(tmp_path / "imported", dtype="float32", device=d) for d in ("cpu", "cuda")}
    logits = {d: prompt_logits(e.model, torch.tensor(PROMPT_IDS, device=d)).cpu()
              for d, e in engines.items()}
    assert ((logits["cuda"] - logits["cpu"]).norm() / logits["cpu"].norm()).item() <= 1e-4
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [PROMPT_IDS[0], PROMPT_IDS[0][:5], PROMPT_IDS[0][2:]]
    tokens = {d: [o.outputs[0].token_ids for o in e.generate(prompts, params)]
              for d, e in engines.items()}
    assert tokens["cuda"] == tokens["cpu"]
