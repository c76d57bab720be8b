"""HF model_type -> our config parser and model class (imported lazily)."""

from __future__ import annotations

from typing import Any

from deltaserve.config import TEXT_MODEL_TYPES, TextConfig
from deltaserve.errors import ConfigError


def text_config_for(raw: dict[str, Any]) -> TextConfig:
    model_type = raw.get("model_type")
    if model_type not in TEXT_MODEL_TYPES:
        raise ConfigError(
            f"unknown model_type {model_type!r} in config.json (supported: {', '.join(TEXT_MODEL_TYPES)})"
        )
    return TextConfig.from_hf(raw)


def text_model_class(model_type: str):
    if model_type in TEXT_MODEL_TYPES:
        from deltaserve.models.qwen3_5 import Qwen3_5ForCausalLM

        return Qwen3_5ForCausalLM
    raise ConfigError(f"unknown model_type {model_type!r}")
