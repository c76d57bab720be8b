"""MiniCPM-V-4.6 as llama.cpp publishes it: the Qwen3.5 text GGUF plus the vision "mmproj" GGUF
(names and keys as llama.cpp's converter writes them: `clip` architecture, projector minicpmv4_6),
loaded by `--model file.gguf` against the checkpoint folder they came from (fp32, same values)."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from safetensors.torch import load_file, save_file

from deltaserve.errors import CheckpointError
from tests.multimodal.test_engine_images import GREEDY, chat, our_first_logits, picture, rel_l2
from tests.quant.test_gguf_import import write_gguf

gguf = pytest.importorskip("gguf")

# HF -> GGUF as llama.cpp's tensor_mapping gives them for MODEL_ARCH.MMPROJ (minicpmv4_6 rows)
_TO_GGUF = [
    (r"model\.vision_tower\.embeddings\.patch_embedding\.", "v.patch_embd."),
    (r"model\.vision_tower\.embeddings\.position_embedding\.", "v.position_embd."),
    (r"model\.vision_tower\.post_layernorm\.", "v.post_ln."),
    (r"model\.merger\.mlp\.0\.linear_1\.", "mm.up."), (r"model\.merger\.mlp\.0\.linear_2\.", "mm.down."),
    (r"model\.merger\.mlp\.0\.pre_norm\.", "mm.input_norm."),
    (r"model\.vision_tower\.encoder\.layers\.(\d+)\.", r"v.blk.\1."),
    (r"model\.vision_tower\.vit_merger\.linear_1\.", "v.vit_merger.ds_ffn_up."),
    (r"model\.vision_tower\.vit_merger\.linear_2\.", "v.vit_merger.ds_ffn_down."),
    (r"model\.vision_tower\.vit_merger\.pre_norm\.", "v.vit_merger.ds_ln."),
    (r"model\.vision_tower\.vit_merger\.", "v.vit_merger."),
    (r"layer_norm1\.", "ln1."), (r"layer_norm2\.", "ln2."), (r"mlp\.fc1\.", "ffn_up."),
    (r"mlp\.fc2\.", "ffn_down."), (r"self_attn\.q_proj\.", "attn_q."),
    (r"self_attn\.k_proj\.", "attn_k."), (r"self_attn\.v_proj\.", "attn_v."),
    (r"self_attn\.out_proj\.", "attn_out."),
]


def _gguf_name(name: str) -> str:
    for pattern, repl in _TO_GGUF:
        name = re.sub(pattern, repl, name)
    return name


def write_mmproj(src, path, projection_dim=None) -> None:
    cfg = json.loads((src / "config.json").read_text())
    v = cfg["vision_config"]
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.projector_type", "minicpmv4_6")
    for key, val in (("projection_dim", projection_dim or cfg["text_config"]["hidden_size"]),
                     ("image_size", 448), ("patch_size", v["patch_size"]),
                     ("embedding_length", v["hidden_size"]),
                     ("feed_forward_length", v["intermediate_size"]),
                     ("block_count", v["num_hidden_layers"]),
                     ("attention.head_count", v["num_attention_heads"]),
                     ("projector.scale_factor", 4)):
        w.add_uint32(f"clip.vision.{key}", val)
    w.add_array("clip.vision.image_mean", [0.5] * 3)
    w.add_array("clip.vision.image_std", [0.5] * 3)
    w.add_array("clip.vision.wa_layer_indexes", [cfg["insert_layer_id"]])
    w.add_bool("clip.use_gelu", True)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", v["layer_norm_eps"])
    for name, t in load_file(str(src / "model.safetensors")).items():
        if "language_model" not in name:
            w.add_tensor(_gguf_name(name), t.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(the MiniCPM-V-tiny folder, a folder with its text GGUF and mmproj GGUF side by side)."""
    from deltaserve.checkpoint.presets import preset
    from deltaserve.checkpoint.writer import write_checkpoint

    src = tmp_path_factory.mktemp("minicpm")
    write_checkpoint(preset("minicpm-v-tiny"), src, 0)
    raw = json.loads((src / "config.json").read_text())
    flat = tmp_path_factory.mktemp("flat")  # the text model alone, as the converter sees it
    text = {**raw["text_config"], "model_type": "qwen3_5_text", "eos_token_id": raw["eos_token_id"]}
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [11, 11, 10]}
    (flat / "config.json").write_text(json.dumps(text))
    tensors = {k.replace("model.language_model.", "model."): v for k, v in
               load_file(str(src / "model.safetensors")).items() if "language_model" in k}
    save_file(tensors, str(flat / "model.safetensors"))
    files = tmp_path_factory.mktemp("gguf")
    f32 = gguf.GGMLQuantizationType.F32
    write_gguf(flat, files / "MiniCPM-V-tiny-F32.gguf", f32, f32)
    write_mmproj(src, files / "mmproj-MiniCPM-V-tiny-f32.gguf")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, files / name)
    return src, files


def test_the_pair_answers_an_image_question_as_the_folder(pair, tmp_path, monkeypatch) -> None:
    from deltaserve import LLM

    monkeypatch.setenv("DELTASERVE_CACHE_DIR", str(tmp_path))
    src, files = pair
    folder = LLM(src, dtype="float32", max_num_batched_tokens=64)
    paired = LLM(files / "MiniCPM-V-tiny-F32.gguf", dtype="float32", max_num_batched_tokens=64)
    assert paired.images is not None
    image = picture(700, 900, seed=4)  # an overview and slices
    prompt = chat(paired, [{"type": "image", "image": image},
                           {"type": "text", "text": "What is in the picture?"}])
    assert prompt == chat(folder, [{"type": "image", "image": image},
                                   {"type": "text", "text": "What is in the picture?"}])
    want = folder.generate(prompt, GREEDY)[0].outputs[0].token_ids
    assert paired.generate(prompt, GREEDY)[0].outputs[0].token_ids == want
    assert rel_l2(our_first_logits(paired, prompt), our_first_logits(folder, prompt)) < 1e-6


def test_mmproj_flags_and_bad_files(pair, tmp_path, monkeypatch) -> None:
    """--no-mmproj: text only; --mmproj FILE from elsewhere; two beside the model: refused; an
    mmproj for another width, or --mmproj with a folder: one clear error each."""
    from deltaserve.checkpoint.hub import resolve_model_dir

    monkeypatch.setenv("DELTASERVE_CACHE_DIR", str(tmp_path / "cache"))
    src, files = pair
    model = files / "MiniCPM-V-tiny-F32.gguf"
    text_only = json.loads((resolve_model_dir(model, mmproj="none") / "config.json").read_text())
    assert text_only["model_type"] == "qwen3_5_text"
    alone = tmp_path / "alone"
    alone.mkdir()
    for name in (model.name, "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(files / name, alone / name)
    assert json.loads((resolve_model_dir(alone / model.name) / "config.json").read_text())[
        "model_type"] == "qwen3_5_text"
    chosen = resolve_model_dir(alone / model.name, mmproj=files / "mmproj-MiniCPM-V-tiny-f32.gguf")
    assert json.loads((chosen / "config.json").read_text())["model_type"] == "minicpmv4_6"
    write_mmproj(src, alone / "mmproj-other.gguf", projection_dim=96)
    with pytest.raises(CheckpointError, match="projects to width 96"):
        resolve_model_dir(alone / model.name)
    shutil.copy(files / "mmproj-MiniCPM-V-tiny-f32.gguf", alone / "mmproj-second.gguf")
    with pytest.raises(CheckpointError, match="2 mmproj files"):
        resolve_model_dir(alone / model.name)
    with pytest.raises(CheckpointError, match="goes with a .gguf"):
        resolve_model_dir(src, mmproj=alone / "mmproj-second.gguf")
    with pytest.raises(CheckpointError, match="not a MiniCPM-V-4.6 mmproj"):
        resolve_model_dir(alone / model.name, mmproj=model)
