"""Images through the OpenAI server: `image_url` parts as data: URLs, answered exactly as
LLM.generate answers the same prompt; every kind of bad image a 400 (or decoded as the reference
processor decodes it), limits admitted before decoding."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import httpx
import numpy as np
import pytest
from PIL import Image

from deltaserve.engine.sampling import SamplingParams
from tests.server.helpers import app_server

NAME = "minicpm-tiny"


def picture(height: int = 300, width: int = 500, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8))


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def encoded(img: Image.Image, fmt: str = "PNG", **options) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **options)
    return buf.getvalue()


def png_header_only(width_px: int, height_px: int) -> bytes:
    """A PNG declaring width x height pixels with almost no data (a decompression bomb)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(
            ">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width_px, height_px, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0"))


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def vision_llm(tmp_path_factory):
    from deltaserve import LLM
    from deltaserve.checkpoint.presets import preset
    from deltaserve.checkpoint.writer import write_checkpoint
    from deltaserve.multimodal.inputs import ImageLimits

    out = tmp_path_factory.mktemp("minicpm-tiny-server")
    write_checkpoint(preset("minicpm-v-tiny"), out, 0)
    return LLM(out, dtype="float32", image_limits=ImageLimits(max_images=3,
                                                                max_visual_tokens=400))


@pytest.fixture(scope="module")
def offline_llm(vision_llm):
    """A second engine on the same checkpoint (the server's own is driven by its thread)."""
    from deltaserve import LLM

    return LLM(vision_llm.model_dir, dtype="float32")


@pytest.fixture(scope="module")
def base(vision_llm):
    from deltaserve.server.app import build_app

    with app_server(build_app(vision_llm, NAME)) as url:
        yield url


def test_models_card_lists_image_input(base) -> None:
    card = httpx.get(f"{base}/v1/models").json()["data"][0]
    assert card["architecture"]["input_modalities"] == ["text", "image"]


def test_image_answer_equals_the_offline_engine(base, offline_llm) -> None:
    png = encoded(picture())
    messages = user(image_part(data_url(png)), {"type": "text", "text": "What is this?"})
    from openai import OpenAI  # here, as in test_server.py: collecting needs no openai

    client = OpenAI(base_url=f"{base}/v1", api_key="none")
    extra = {"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}}
    reply = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8,
                                           temperature=0, extra_body=extra)
    prompt = offline_llm.chat_prompt(
        user({"type": "image", "image": png}, {"type": "text", "text": "What is this?"}), False)
    offline = offline_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8,
                                                         ignore_eos=True))[0]
    assert reply.choices[0].message.content == offline.outputs[0].text
    assert reply.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert reply.usage.prompt_tokens > 64  # the overview's 64 placeholders are in the prompt
    # streamed, and with the 4x mode (4x the placeholders)
    chunks = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8,
                                            temperature=0, stream=True, extra_body=extra)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        offline.outputs[0].text)
    fine = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=1, temperature=0,
        extra_body={"mm_processor_kwargs": {"downsample_mode": "4x"}})
    assert fine.usage.prompt_tokens > reply.usage.prompt_tokens + 3 * 64 - 8


def _bad_images() -> dict[str, str]:
    png = encoded(picture(40, 60))
    cmyk = encoded(picture(40, 60).convert("CMYK"), "JPEG")
    gray16 = encoded(Image.fromarray(np.full((40, 60), 40000, dtype=np.uint16)))
    frames = [picture(40, 60, seed=s) for s in range(3)]
    gif = encoded(frames[0], "GIF", save_all=True, append_images=frames[1:])
    return {
        # each odd-but-valid kind (decoded when intact, below) broken in transit
        "cmyk-truncated": data_url(cmyk[: len(cmyk) // 3], "image/jpeg"),
        "16bit-truncated": data_url(gray16[: len(gray16) // 2]),
        "animated-truncated": data_url(gif[: len(gif) // 6], "image/gif"),  # inside frame 0
        "truncated": data_url(png[: len(png) // 2]),
        "zero-size": data_url(b""),
        "bomb": data_url(png_header_only(30_000, 30_000)),
        "wrong-type": data_url(b"%PDF-1.4 not an image", "image/png"),
        "tiff": data_url(encoded(picture(40, 60), "TIFF"), "image/png"),
        "not-a-url": "malformed",
        "server-path": "/etc/hostname",  # never read from the server's disk
        "long-name": "x" * 5000,
        "http": "http://169.254.169.254/latest/meta-data",
        "bad-base64": "data:image/png;base64,@@@",
    }


@pytest.mark.parametrize("kind", list(_bad_images()))
def test_bad_images_are_400s(base, kind) -> None:
    body = {"model": NAME, "max_tokens": 4,
            "messages": user(image_part(_bad_images()[kind]), {"type": "text", "text": "?"})}
    response = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "messages"


@pytest.mark.parametrize("mode", ["CMYK", "I;16", "animated"])
def test_odd_but_valid_images_are_decoded_like_the_reference(base, mode) -> None:
    """CMYK, 16-bit grayscale and animated images are what users send: they are decoded (CMYK
    converted, 16-bit scaled, the first frame), as transformers' processor takes them."""
    img = picture(60, 80)
    if mode == "CMYK":
        data = encoded(img.convert("CMYK"), "JPEG")
    elif mode == "I;16":
        gray = (np.asarray(img.convert("L"), dtype=np.uint16) * 257).astype(np.uint16)
        data = encoded(Image.fromarray(gray))
    else:
        frames = [picture(60, 80, seed=s) for s in range(3)]
        data = encoded(frames[0], "GIF", save_all=True, append_images=frames[1:])
    body = {"model": NAME, "max_tokens": 2, "temperature": 0,
            "messages": user(image_part(data_url(data)), {"type": "text", "text": "?"})}
    response = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text


def test_limits_are_400s_and_text_only_models_refuse_images(base, tiny_llm) -> None:
    from deltaserve.server.app import build_app

    url = data_url(encoded(picture(40, 60)))
    four = user(*[image_part(url)] * 4, {"type": "text", "text": "?"})
    response = httpx.post(f"{base}/v1/chat/completions", timeout=60,
                          json={"model": NAME, "max_tokens": 2, "messages": four})
    assert response.status_code == 400 and "limit is 3" in response.json()["error"]["message"]
    big = data_url(encoded(Image.new("RGB", (1600, 1200), "navy")))  # over 400 visual tokens
    response = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
        "model": NAME, "max_tokens": 2, "messages": user(image_part(big), image_part(big))})
    assert response.status_code == 400 and "visual tokens" in response.text
    odd = user({"type": "input_audio", "input_audio": {}})
    response = httpx.post(f"{base}/v1/chat/completions", timeout=60,
                          json={"model": NAME, "max_tokens": 2, "messages": odd})
    assert response.status_code == 400 and "input_audio" in response.text
    with app_server(build_app(tiny_llm, "tiny")) as text_base:
        response = httpx.post(f"{text_base}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "max_tokens": 2, "messages": user(image_part(url))})
        assert response.status_code == 400 and "takes no images" in response.text
        card = httpx.get(f"{text_base}/v1/models").json()["data"][0]
        assert card["architecture"]["input_modalities"] == ["text"]


@pytest.fixture
def decodes(monkeypatch) -> list[tuple[int, int]]:
    """The size of every image whose pixels get decoded (Pillow's load) while the test runs."""
    from PIL import ImageFile

    seen: list[tuple[int, int]] = []
    load = ImageFile.ImageFile.load

    def counting_load(self):
        seen.append(self.size)
        return load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", counting_load)
    return seen


def test_visual_token_budget_is_checked_before_any_image_is_decoded(
        base, vision_llm, decodes, monkeypatch) -> None:
    """Issue 31: eight 6000x6000 PNGs at the default limits (8 images, 4096 visual tokens) were
    all decoded (15 s) before the budget refused them; their headers alone refuse them now."""
    from deltaserve.multimodal.inputs import ImageLimits

    monkeypatch.setattr(vision_llm.images, "limits", ImageLimits())
    big = data_url(encoded(Image.new("RGB", (6000, 6000), "white")))  # ~100 kB, 640 tokens
    body = {"model": NAME, "max_tokens": 2,
            "messages": user(*[image_part(big)] * 8, {"type": "text", "text": "?"})}
    response = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 400 and "5120 visual tokens" in response.text, response.text
    assert response.json()["error"]["code"] == "invalid_image"
    assert decodes == []


def test_a_bad_header_after_a_good_image_is_refused_before_decoding_either(base, decodes) -> None:
    good = image_part(data_url(encoded(picture(40, 60))))
    for bad in (data_url(png_header_only(30_000, 30_000)), data_url(b"%PDF-1.4", "image/png")):
        response = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "model": NAME, "max_tokens": 2, "messages": user(good, image_part(bad))})
        assert response.status_code == 400, response.text
    assert decodes == []
    # a valid header over corrupt pixel data still reaches the decoder, and is a 400 there
    png = encoded(picture(40, 60))
    response = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
        "model": NAME, "max_tokens": 2,
        "messages": user(good, image_part(data_url(png[: len(png) // 2])))})
    assert response.status_code == 400 and "truncated or corrupt" in response.text
