"""Prompts with images -> what the engine runs: token ids with one placeholder per visual token,
and the vision tower's embeddings for those positions (engine/request.ImageInputs).

Every check (count, bytes, pixels, visual tokens, placeholders) runs before the tower does, so a
refused request costs no vision compute and changes no engine state.

Prefix-cache keys: the placeholder id is the same for every image, so the prefix cache would
confuse two images of one size. Each placeholder's key id is instead a 62-bit digest of its
image's pixels, pieces and mode, negated (real token ids are never negative): an image prompt
hits a snapshot only when its images are the same ones, and a follow-up turn about an earlier
image reuses the first turn's state.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from deltaserve.engine.request import ImageInputs
from deltaserve.errors import ConfigError, RequestError
from deltaserve.multimodal.image import (
    OpenedImage,
    decode_opened,
    open_image,
    parse_data_url,
)
from deltaserve.multimodal.limits import ImageLimits
from deltaserve.multimodal.processor import (
    IMAGE_PAD,
    ProcessedImage,
    expand_image_placeholders,
    num_visual_tokens,
    pack_images,
    process_image,
)

_DEFAULT_LIMITS = ImageLimits()
# A path, a data: URL, encoded bytes, or an already decoded PIL image.
ImageSource = str | Path | bytes | Image.Image



def open_image_source(source: ImageSource, limits: ImageLimits) -> OpenedImage:
    """One image source with only its header read and checked (a PIL image as given), every
    failure a RequestError: no pixel is decoded, so a request's every image can be refused by
    size before any is."""
    if isinstance(source, Image.Image):
        if source.width * source.height > limits.max_image_pixels:
            raise RequestError(f"image has {source.width * source.height} pixels, over the "
                               f"limit of {limits.max_image_pixels}")
        return OpenedImage(source, ((source.height, source.width),))
    if isinstance(source, bytes):
        return open_image(source, limits.max_image_bytes, limits.max_image_pixels)
    if isinstance(source, str) and source.startswith("data:"):
        data = parse_data_url(source, limits.max_image_bytes)
        return open_image(data, limits.max_image_bytes, limits.max_image_pixels)
    if isinstance(source, str) and source.startswith(("http://", "https://")):
        raise RequestError("image URLs are not fetched (give the bytes as a data: URL)")
    if not isinstance(source, str | Path):
        raise RequestError(f"an image must be a path, data: URL, bytes or PIL image, got "
                           f"{type(source).__name__}")
    path = Path(source)
    try:
        if not path.is_file():
            raise RequestError(f"image file not found: {str(path)[:200]}")
        size = path.stat().st_size
        if size > limits.max_image_bytes:
            raise RequestError(f"image file {path} has {size} bytes, over the limit of "
                               f"{limits.max_image_bytes}")
        data = path.read_bytes()
    except OSError as exc:  # a name too long, a permission, a directory...
        raise RequestError(f"cannot read image file {str(path)[:200]}: {exc.strerror}") from exc
    return open_image(data, limits.max_image_bytes, limits.max_image_pixels)


def header_visual_tokens(opened: OpenedImage, mode: str) -> int:
    """An opened image's visual tokens, from its size alone: exact, or the smaller of its two
    orientations' counts where only decoding tells the orientation (rare: see OpenedImage)."""
    return min(num_visual_tokens(size_px, mode) for size_px in opened.sizes_px)


def image_key(image: ProcessedImage) -> int:
    """A negative int naming the image's content as the tower sees it (pixels, pieces, mode)."""
    digest = hashlib.blake2b(digest_size=8)
    # the processor's digest of the uint8 pixels the float ones are made from, else those
    digest.update(image.content_digest or image.pixel_values.numpy().tobytes())
    digest.update(repr((image.grid_hw, image.slice_grid, image.mode)).encode())
    return -1 - (int.from_bytes(digest.digest(), "little") >> 2)


class ImagePrompts:
    """The multimodal front of an LLM: text with one `<|image_pad|>` per image + the images ->
    (prompt ids, ImageInputs), the tower run on the model's device."""

    def __init__(self, vision_model, tokenizer, image_token_id: int, act_dtype: torch.dtype,
                 limits: ImageLimits = _DEFAULT_LIMITS, cache_bytes: int = 64 << 20) -> None:
        self.vision, self.tokenizer, self.limits = vision_model, tokenizer, limits
        self.image_token_id, self.act_dtype = image_token_id, act_dtype
        # image key -> its embeddings [tokens, N]: a chat re-sends earlier images every turn, and
        # the tower (2.3 s per 448² image on 2 CPU cores) need not run for them again
        self.cache: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.cache_bytes, self.cached_bytes, self.num_tower_images = cache_bytes, 0, 0
        if tokenizer.token_id(IMAGE_PAD) != image_token_id:
            raise ConfigError(f"the tokenizer maps {IMAGE_PAD} to {tokenizer.token_id(IMAGE_PAD)}"
                               f" but config.json's image_token_id is {image_token_id}")

    @property
    def default_mode(self) -> str:
        return self.vision.cfg.downsample_mode

    def process(self, images: Sequence[ImageSource], mode: str | None = None
                ) -> list[ProcessedImage]:
        """Decode and slice every image, within the limits (no tower work yet); the pixel and
        visual-token limits are checked on every image's header before any image is decoded."""
        if len(images) > self.limits.max_images:
            raise RequestError(f"{len(images)} images in one request; the limit is "
                               f"{self.limits.max_images}")
        mode = mode or self.default_mode
        # every header first: a request over a limit is refused before any image is decoded
        opened = [(src, open_image_source(src, self.limits)) for src in images]
        self._check_visual_tokens(sum(header_visual_tokens(o, mode) for _, o in opened))
        processed = []
        while opened:  # popped as they go: one decoded image alive at a time, as before
            src, item = opened.pop(0)
            image = src if isinstance(src, Image.Image) else decode_opened(item.image)
            processed.append(process_image(image, mode))
            del image, item
        # the same count, except where only decoding told an image's orientation
        self._check_visual_tokens(sum(p.total_tokens for p in processed))
        return processed

    def _check_visual_tokens(self, num_tokens: int) -> None:
        if num_tokens > self.limits.max_visual_tokens:
            raise RequestError(f"the images need {num_tokens} visual tokens; the limit per "
                               f"request is {self.limits.max_visual_tokens}")

    def expand(self, text: str, processed: Sequence[ProcessedImage],
               encode: Callable[[str], list[int]] | None = None) -> list[int]:
        """text holding one IMAGE_PAD per image -> prompt ids, one placeholder per visual token
        (encode: the tokenizer's, or a chat prompt's that keeps its messages' markers apart)."""
        if not isinstance(text, str):
            raise RequestError(f"a prompt with images must be text holding one {IMAGE_PAD} per "
                               "image")
        ids = (encode or self.tokenizer.encode)(expand_image_placeholders(text, processed))
        num_placeholders = sum(t == self.image_token_id for t in ids)
        num_needed = sum(p.total_tokens for p in processed)
        if num_placeholders != num_needed:
            raise RequestError(f"the prompt has {num_placeholders} image placeholder tokens but "
                               f"its images need {num_needed}")
        return ids

    def inputs(self, ids: list[int], processed: Sequence[ProcessedImage]) -> ImageInputs:
        """The tower's embeddings for expand's ids, with the content-keyed cache ids."""
        positions = [i for i, t in enumerate(ids) if t == self.image_token_id]
        keys = [image_key(image) for image in processed]
        embeds = self.embed(processed, keys)
        key_ids, start = list(ids), 0
        for image, key in zip(processed, keys, strict=True):
            for pos in positions[start : start + image.total_tokens]:
                key_ids[pos] = key
            start += image.total_tokens
        return ImageInputs(tuple(positions), embeds, tuple(key_ids))

    def encode(self, text: str, images: Sequence[ImageSource], mode: str | None = None,
               check_ids: Callable[[list[int]], object] | None = None,
               ) -> tuple[list[int], ImageInputs]:
        """process + expand + inputs; check_ids (e.g. the context limit) runs on the ids
        before the tower does."""
        processed = self.process(images, mode)
        ids = self.expand(text, processed)
        if check_ids is not None:
            check_ids(ids)
        return ids, self.inputs(ids, processed)

    @torch.inference_mode()
    def embed(self, processed: Sequence[ProcessedImage], keys: Sequence[int] | None = None
              ) -> torch.Tensor:
        """[visual tokens, N] (activation dtype) for the images in order: cached ones by key,
        the others through the tower + projector in one packed call."""
        keys = [image_key(p) for p in processed] if keys is None else list(keys)
        missing = {k: p for k, p in zip(keys, processed, strict=True) if k not in self.cache}
        if missing:
            images = list(missing.values())
            pixel_values, grid_hw = pack_images(images)
            param = next(self.vision.parameters())
            features = self.vision(pixel_values.to(param.device, param.dtype), grid_hw,
                                   images[0].mode).to(self.act_dtype)
            self.num_tower_images += len(images)
            rows = features.split([p.total_tokens for p in images])
            fresh = dict(zip(missing, rows, strict=True))
        else:
            fresh = {}
        out = torch.cat([fresh[k] if k in fresh else self.cache[k] for k in keys])
        for key in keys:  # every image of this request becomes the most recently used
            self._remember(key, fresh.get(key))
        return out

    def _remember(self, key: int, rows: torch.Tensor | None) -> None:
        if rows is None:
            self.cache.move_to_end(key)
            return
        nbytes = rows.numel() * rows.element_size()
        if nbytes > self.cache_bytes or key in self.cache:
            return
        self.cache[key] = rows.clone()  # not a view of this request's whole feature tensor
        self.cached_bytes += nbytes
        while self.cached_bytes > self.cache_bytes:
            _, old = self.cache.popitem(last=False)
            self.cached_bytes -= old.numel() * old.element_size()


def message_images(messages: list[dict[str, Any]]) -> list[ImageSource]:
    """The image parts of OpenAI-shaped chat messages, in order: {"type": "image_url",
    "image_url": {"url": ...}} (or the URL as a plain string) and {"type": "image", "image": ...}
    (a path, bytes, data: URL or PIL image). The chat template renders one IMAGE_PAD for each."""
    sources: list[ImageSource] = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, dict):
                continue
            if part.get("type") == "image_url" or "image_url" in part:
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str):
                    raise RequestError("an image_url part needs {'url': '...'}")
                sources.append(url)
            elif part.get("type") == "image" or "image" in part:
                if part.get("image") is None:
                    raise RequestError("an image part needs an 'image' (a path, bytes, data: "
                                       "URL or PIL image)")
                sources.append(part["image"])
    return sources
