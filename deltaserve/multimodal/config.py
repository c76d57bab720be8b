"""`VisionConfig`: the vision tower and projector of a MiniCPM-V-4.6 config.json, typed, checked."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deltaserve.errors import ConfigError

VISION_MODEL_TYPES = ("minicpmv4_6",)
DOWNSAMPLE_MODES = ("16x", "4x")
# Patches merged per side between the tower's input and the language model: the window merger's
# 2x2 and the projector's 2x2 in 16x mode, the projector's alone in 4x mode. The processor sizes
# pieces to multiples of it and the placeholder count divides by its square, so both sides agree.
MERGE_SIDE_PATCHES = {"16x": 4, "4x": 2}
# The only activation the tower's MLPs and window merger use (transformers' gelu_pytorch_tanh).
TANH_GELU = "gelu_pytorch_tanh"


def num_piece_tokens(grid_h: int, grid_w: int, mode: str) -> int:
    """Language-model tokens the tower emits for one piece of grid_h x grid_w patches."""
    return grid_h * grid_w // MERGE_SIDE_PATCHES[mode] ** 2


def _require(cfg: dict[str, Any], key: str, where: str) -> Any:
    if key not in cfg:
        raise ConfigError(f"config.json: field '{key}' missing from {where}")
    return cfg[key]


def _pair(value: Any, key: str) -> tuple[int, int]:
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise ConfigError(f"config.json: '{key}' must be a pair [h, w], got {value!r}")
    return int(value[0]), int(value[1])


@dataclass(frozen=True, slots=True)
class VisionConfig:
    """Every dimension of the image path. Sizes named `*_px` are pixels; grids are in patches.

    `downsample_mode` is only the default: the mode may be chosen per call (same weights).
    """

    hidden_size: int  # C, the tower's width
    intermediate_size: int  # I, the encoder MLP width
    num_hidden_layers: int
    num_attention_heads: int
    num_channels: int
    image_size_px: int  # side of the square the position table was trained on
    patch_size_px: int
    layer_norm_eps: float
    insert_layer_id: int  # the window merger runs right after this encoder layer (16x mode)
    text_hidden_size: int  # projector output width = the language model's hidden size
    hidden_act: str = TANH_GELU
    downsample_mode: str = "16x"
    window_kernel_size: tuple[int, int] = (2, 2)
    merge_kernel_size: tuple[int, int] = (2, 2)
    merger_times: int = 1

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                "config.json: vision hidden_size must be a multiple of num_attention_heads"
            )
        if self.hidden_act != TANH_GELU:
            raise ConfigError(
                f"config.json: vision hidden_act '{self.hidden_act}' is not supported ({TANH_GELU})"
            )
        if not 0 <= self.insert_layer_id < self.num_hidden_layers:
            raise ConfigError(
                f"config.json: insert_layer_id {self.insert_layer_id} is outside the "
                f"{self.num_hidden_layers} vision layers"
            )
        if self.downsample_mode not in DOWNSAMPLE_MODES:
            raise ConfigError(
                f"config.json: downsample_mode '{self.downsample_mode}' is not one of "
                f"{', '.join(DOWNSAMPLE_MODES)}"
            )
        # The published model merges 2x2 once; other kernels and rounds are untested here.
        if self.window_kernel_size != (2, 2) or self.merge_kernel_size != (2, 2):
            raise ConfigError("config.json: only 2x2 window and merge kernels are supported")
        if self.merger_times != 1:
            raise ConfigError(f"config.json: merger_times {self.merger_times} is not supported (1)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_patches_per_side(self) -> int:
        """Side of the learned 2-D position table (70 for 980 px / 14 px)."""
        return self.image_size_px // self.patch_size_px

    @property
    def window_area(self) -> int:
        return self.window_kernel_size[0] * self.window_kernel_size[1]

    @property
    def merge_area(self) -> int:
        return self.merge_kernel_size[0] * self.merge_kernel_size[1]

    @property
    def window_intermediate_size(self) -> int:
        """The window merger's MLP width: 4 * I (17216 for the published model)."""
        return self.intermediate_size * self.window_area

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> VisionConfig:
        """From a `minicpmv4_6` config.json; absent fields take transformers' class defaults."""
        model_type = raw.get("model_type")
        if model_type not in VISION_MODEL_TYPES:
            raise ConfigError(
                f"config.json: model_type {model_type!r} has no vision tower we support "
                f"({', '.join(VISION_MODEL_TYPES)})"
            )
        vision = _require(raw, "vision_config", f"a '{model_type}' config")
        text = _require(raw, "text_config", f"a '{model_type}' config")
        get = lambda key: _require(vision, key, "vision_config")  # noqa: E731
        # transformers copies the top-level insert_layer_id into the vision config
        insert = raw.get("insert_layer_id", vision.get("insert_layer_id", 6))
        return cls(
            hidden_size=int(get("hidden_size")),
            intermediate_size=int(get("intermediate_size")),
            num_hidden_layers=int(get("num_hidden_layers")),
            num_attention_heads=int(get("num_attention_heads")),
            num_channels=int(vision.get("num_channels", 3)),
            image_size_px=int(get("image_size")),
            patch_size_px=int(get("patch_size")),
            layer_norm_eps=float(vision.get("layer_norm_eps", 1e-6)),
            insert_layer_id=int(insert),
            text_hidden_size=int(_require(text, "hidden_size", "text_config")),
            hidden_act=str(vision.get("hidden_act", TANH_GELU)),
            downsample_mode=str(raw.get("downsample_mode", "16x")),
            window_kernel_size=_pair(
                vision.get("window_kernel_size", (2, 2)), "window_kernel_size"
            ),
            merge_kernel_size=_pair(raw.get("merge_kernel_size", (2, 2)), "merge_kernel_size"),
            merger_times=int(raw.get("merger_times", 1)),
        )
