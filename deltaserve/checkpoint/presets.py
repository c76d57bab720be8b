"""config.json of each synthetic preset: the published Qwen3.5 / MiniCPM-V-4.6 configs, plus `tiny`."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

_L, _F = "linear_attention", "full_attention"


def _layer_types(num_layers: int) -> list[str]:
    return [_F if (i + 1) % 4 == 0 else _L for i in range(num_layers)]


def text_config(
    hidden: int, inter: int, layers: int, heads: int, kv: int, lk: int, lv: int, tie: bool
) -> dict[str, Any]:
    return {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "dtype": "bfloat16",
        "eos_token_id": 248044,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": inter,
        "layer_types": _layer_types(layers),
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": lk,
        "linear_num_value_heads": lv,
        "linear_value_head_dim": 128,
        "max_position_embeddings": 262144,
        "mlp_only_layers": [],
        "model_type": "qwen3_5_text",
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": tie,
        "use_cache": True,
        "vocab_size": 248320,
        "mamba_ssm_dtype": "float32",
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
        },
    }


def _qwen(text: dict[str, Any], vision: tuple[int, int, int, int, int]) -> dict[str, Any]:
    depth, v_hidden, v_inter, v_heads, out_hidden = vision
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "image_token_id": 248056,
        "model_type": "qwen3_5",
        "text_config": text,
        "tie_word_embeddings": text["tie_word_embeddings"],
        "transformers_version": "4.57.0.dev0",
        "video_token_id": 248057,
        "vision_config": {
            "deepstack_visual_indexes": [],
            "depth": depth,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_size": v_hidden,
            "in_channels": 3,
            "initializer_range": 0.02,
            "intermediate_size": v_inter,
            "model_type": "qwen3_5",
            "num_heads": v_heads,
            "num_position_embeddings": 2304,
            "out_hidden_size": out_hidden,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        "vision_end_token_id": 248054,
        "vision_start_token_id": 248053,
    }


def _minicpm() -> dict[str, Any]:
    text = text_config(1024, 3584, 24, 8, 2, 16, 16, True)
    text.pop("dtype")
    text["vocab_size"], text["partial_rotary_factor"] = 248094, 0.25
    text["rope_parameters"] = {
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000000,
        "rope_type": "default",
    }
    return {
        "architectures": ["MiniCPMV4_6ForConditionalGeneration"],
        "bos_token_id": None,
        "drop_vision_last_layer": False,
        "eos_token_id": 248044,
        "image_size": 1120,
        "model_type": "minicpmv4_6",
        "pad_token_id": None,
        "tie_word_embeddings": True,
        "transformers_version": "5.7.0",
        "use_cache": True,
        "vision_config": {
            "attention_dropout": 0.0,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_size": 1152,
            "image_size": 980,
            "intermediate_size": 4304,
            "layer_norm_eps": 1e-06,
            "model_type": "minicpmv4_6_vision",
            "num_attention_heads": 16,
            "num_channels": 3,
            "num_hidden_layers": 27,
            "patch_size": 14,
        },
        "text_config": text,
        "insert_layer_id": 6,
        "image_token_id": 248056,
        "video_token_id": 248057,
    }


def _minicpm_tiny() -> dict[str, Any]:
    """MiniCPM-V-4.6's names, vocabulary and prompt layout at test size: the tiny text model
    (width 128) and a 4-layer vision tower of width 64 (window merger after layer 1)."""
    cfg = _minicpm()
    tiny = _tiny()
    text = cfg["text_config"]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "layer_types",
                "num_attention_heads", "num_key_value_heads", "head_dim", "linear_num_key_heads",
                "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                "max_position_embeddings"):
        text[key] = tiny[key]
    cfg["vision_config"].update(hidden_size=64, num_attention_heads=4, intermediate_size=96,
                                num_hidden_layers=4)
    cfg["insert_layer_id"] = 1
    return cfg


def _tiny() -> dict[str, Any]:
    """A flat text-only config small enough for tests; V heads != K heads on purpose."""
    cfg = text_config(128, 256, 8, 4, 2, 2, 4, True)
    cfg.update(
        head_dim=64,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        max_position_embeddings=4096,
        architectures=["Qwen3_5ForCausalLM"],
    )
    return cfg


@dataclass(frozen=True, slots=True)
class Preset:
    name: str
    config: dict[str, Any]
    num_shards: int  # 0 = one plain model.safetensors without an index
    expected_tensors: int | None = None  # published counts and byte totals (formats.md 2.4, 3.2)
    expected_bytes: int | None = None
    generation_config: dict[str, Any] | None = None


_QWEN_GEN = {
    "bos_token_id": 248044,
    "eos_token_id": [248046, 248044],
    "pad_token_id": 248044,
    "do_sample": True,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
}
_MINICPM_GEN = {
    "bos_token_id": 248045,
    "eos_token_id": [248044, 248046],
    "do_sample": True,
    "temperature": 0.7,
    "top_k": 0,
    "top_p": 1.0,
}

PRESETS: dict[str, Preset] = {
    "tiny": Preset("tiny", _tiny(), 0, generation_config=_QWEN_GEN),
    "qwen3.5-0.8b": Preset(
        "qwen3.5-0.8b",
        _qwen(text_config(1024, 3584, 24, 8, 2, 16, 16, True), (12, 768, 3072, 12, 1024)),
        1,
        488,
        1_746_882_752,
        _QWEN_GEN,
    ),
    "qwen3.5-2b": Preset(
        "qwen3.5-2b",
        _qwen(text_config(2048, 6144, 24, 8, 2, 16, 16, True), (24, 1024, 4096, 16, 2048)),
        1,
        632,
        4_548_144_832,
        _QWEN_GEN,
    ),
    "qwen3.5-27b": Preset(
        "qwen3.5-27b",
        _qwen(text_config(5120, 17408, 64, 24, 4, 16, 48, False), (27, 1152, 4304, 16, 5120)),
        11,
        1199,
        55_562_872_800,
        _QWEN_GEN,
    ),
    "minicpm-v-4.6": Preset("minicpm-v-4.6", _minicpm(), 0, 779, 2_600_856_032, _MINICPM_GEN),
    "minicpm-v-tiny": Preset("minicpm-v-tiny", _minicpm_tiny(), 0, None, None, _MINICPM_GEN),
}


def preset(name: str) -> Preset:
    from deltaserve.errors import ConfigError

    if name not in PRESETS:
        raise ConfigError(f"unknown preset '{name}' (choose {', '.join(PRESETS)})")
    p = PRESETS[name]
    return Preset(
        p.name,
        copy.deepcopy(p.config),
        p.num_shards,
        p.expected_tensors,
        p.expected_bytes,
        copy.deepcopy(p.generation_config),
    )
