"""Typed model and engine configs (frozen dataclasses), built from HF config.json in its three forms."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deltaserve.errors import ConfigError

TEXT_MODEL_TYPES = ("qwen3_5_text", "qwen3_5", "minicpmv4_6")
LINEAR, FULL = "linear_attention", "full_attention"


def _require(cfg: dict[str, Any], key: str, where: str) -> Any:
    if key not in cfg:
        raise ConfigError(f"config.json: field '{key}' missing from {where}")
    return cfg[key]


@dataclass(frozen=True, slots=True)
class TextConfig:
    """The Qwen3.5 hybrid decoder; every dimension comes from the checkpoint's config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    hidden_act: str = "silu"
    model_type: str = "qwen3_5_text"
    mrope_section: tuple[int, ...] = field(default=(11, 11, 10))

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"config.json: layer_types has {len(self.layer_types)} entries "
                f"but num_hidden_layers is {self.num_hidden_layers}"
            )
        bad = sorted(set(self.layer_types) - {LINEAR, FULL})
        if bad:
            raise ConfigError(f"config.json: unknown layer type(s) {bad}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                "config.json: num_attention_heads must be a multiple of num_key_value_heads"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(
                "config.json: linear_num_value_heads must be a multiple of linear_num_key_heads"
            )
        if self.hidden_act != "silu":
            raise ConfigError(
                f"config.json: hidden_act '{self.hidden_act}' is not supported (silu)"
            )

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> TextConfig:
        """Accept flat `qwen3_5_text`, nested `qwen3_5` and `minicpmv4_6` (both with text_config)."""
        model_type = raw.get("model_type")
        if model_type not in TEXT_MODEL_TYPES:
            raise ConfigError(
                f"config.json: unknown model_type {model_type!r} "
                f"(supported: {', '.join(TEXT_MODEL_TYPES)})"
            )
        if model_type == "qwen3_5_text":
            text, top = raw, raw
        else:
            text, top = _require(raw, "text_config", f"a '{model_type}' config"), raw
        return cls._from_text(text, top)

    @classmethod
    def _from_text(cls, text: dict[str, Any], top: dict[str, Any]) -> TextConfig:
        where = "text_config" if text is not top else "config"
        num_layers = int(_require(text, "num_hidden_layers", where))
        layer_types = text.get("layer_types")
        if layer_types is None:  # as transformers: every full_attention_interval-th layer is full
            interval = int(text.get("full_attention_interval", 4))
            layer_types = [LINEAR if (i + 1) % interval else FULL for i in range(num_layers)]
        rope = text.get("rope_parameters") or {}
        partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
        theta = rope.get("rope_theta", text.get("rope_theta", 10_000_000))
        tie = text.get("tie_word_embeddings", top.get("tie_word_embeddings", False))
        eos = text.get("eos_token_id", top.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        get = lambda key: _require(text, key, where)  # noqa: E731
        return cls(
            vocab_size=int(get("vocab_size")),
            hidden_size=int(get("hidden_size")),
            intermediate_size=int(get("intermediate_size")),
            num_hidden_layers=num_layers,
            layer_types=tuple(layer_types),
            num_attention_heads=int(get("num_attention_heads")),
            num_key_value_heads=int(get("num_key_value_heads")),
            head_dim=int(
                text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
            ),
            linear_num_key_heads=int(get("linear_num_key_heads")),
            linear_num_value_heads=int(get("linear_num_value_heads")),
            linear_key_head_dim=int(get("linear_key_head_dim")),
            linear_value_head_dim=int(get("linear_value_head_dim")),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            partial_rotary_factor=float(partial),
            max_position_embeddings=int(text.get("max_position_embeddings", 262144)),
            tie_word_embeddings=bool(tie),
            eos_token_ids=eos_ids,
            hidden_act=str(text.get("hidden_act", "silu")),
            model_type=str(text.get("model_type", "qwen3_5_text")),
            mrope_section=tuple(rope.get("mrope_section", (11, 11, 10))),
        )
