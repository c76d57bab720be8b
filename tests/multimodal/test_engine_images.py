"""Images through the engine (MiniCPM-V-4.6 layout at test size, `minicpm-v-tiny`), against
transformers' MiniCPMV4_6ForConditionalGeneration on the same checkpoint, FP32."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from deltaserve.engine.sampling import SamplingParams
from deltaserve.errors import RequestError
from deltaserve.multimodal.processor import IMAGE_PAD, pack_images, process_image

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def picture(height: int, width: int, seed: int) -> Image.Image:
    """Smooth gradients plus noise: resizing keeps structure, so images differ after slicing."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([(xx * (1 + seed)) % 256, (yy * 3) % 256, (xx + yy) % 256], axis=-1)
    noise = rng.integers(0, 64, (height, width, 3))
    return Image.fromarray(((base + noise) % 256).astype(np.uint8))


@pytest.fixture(scope="module")
def minicpm_dir(tmp_path_factory):
    from deltaserve.checkpoint.presets import preset
    from deltaserve.checkpoint.writer import write_checkpoint

    out = tmp_path_factory.mktemp("minicpm-tiny")
    write_checkpoint(preset("minicpm-v-tiny"), out, 0)
    return out


@pytest.fixture(scope="module")
def llm(minicpm_dir):
    from deltaserve import LLM

    return LLM(minicpm_dir, dtype="float32", max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def reference(minicpm_dir):
    from transformers import MiniCPMV4_6ForConditionalGeneration

    model = MiniCPMV4_6ForConditionalGeneration.from_pretrained(minicpm_dir, dtype=torch.float32)
    return model.eval()


def reference_greedy(model, ids: list[int], images: list[Image.Image], num_tokens: int,
                     mode: str = "16x") -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation (full forward per token) and its first logits."""
    pixel_values, grid = pack_images([process_image(img, mode) for img in images])
    sizes = torch.tensor(grid, dtype=torch.int32)
    x, tokens, first = torch.tensor([ids]), [], None
    with torch.no_grad():
        for _ in range(num_tokens):
            logits = model(input_ids=x, pixel_values=pixel_values, target_sizes=sizes,
                           downsample_mode=mode).logits[0, -1]
            first = logits if first is None else first
            tokens.append(int(logits.argmax()))
            x = torch.cat([x, torch.tensor([[tokens[-1]]])], dim=1)
    return tokens, first


def our_first_logits(llm, prompt) -> torch.Tensor:
    """The logits the engine samples the first token from (runner output, captured)."""
    seen: list[torch.Tensor] = []
    execute = llm.engine.runner.execute

    def wrapped(plan, all_ids, feed=None, images=None, hidden=False):
        out = execute(plan, all_ids, feed, images, hidden)
        seen.extend(out[rid].clone() for rid in out)
        return out

    llm.engine.runner.execute = wrapped
    try:
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1))
    finally:
        llm.engine.runner.execute = execute
    return seen[0]


def chat(llm, content, history=()):
    return llm.chat_prompt([*history, {"role": "user", "content": content}], False)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("size", [(300, 500), (700, 900)], ids=["overview", "5-slices"])
def test_image_question_matches_transformers(llm, reference, size) -> None:
    image = picture(*size, seed=1)
    prompt = chat(llm, [{"type": "image", "image": image},
                        {"type": "text", "text": "What is in the picture?"}])
    out = llm.generate(prompt, GREEDY)[0]
    if size == (700, 900):
        assert len(process_image(image).grid_hw) == 1 + 4  # overview + 2x2 slices
    expected, first = reference_greedy(reference, out.prompt_token_ids, [image], 10)
    assert out.outputs[0].token_ids == expected
    assert rel_l2(our_first_logits(llm, prompt), first) < 1e-5


def test_two_images_and_a_follow_up_turn(llm, reference) -> None:
    images = [picture(300, 500, seed=2), picture(460, 460, seed=3)]
    content = [{"type": "image", "image": images[0]}, {"type": "text", "text": "and"},
               {"type": "image", "image": images[1]}, {"type": "text", "text": "differ how?"}]
    first = llm.generate(chat(llm, content), GREEDY)[0]
    expected, _ = reference_greedy(reference, first.prompt_token_ids, images, 10)
    assert first.outputs[0].token_ids == expected
    history = [{"role": "user", "content": content},
               {"role": "assistant", "content": first.outputs[0].text}]
    follow = llm.generate(chat(llm, "Which one is brighter?", history), GREEDY)[0]
    expected, _ = reference_greedy(reference, follow.prompt_token_ids, images, 10)
    assert follow.outputs[0].token_ids == expected


def test_image_prompts_through_padded_prefill_steps(minicpm_dir, reference) -> None:
    """The padded prefill step a CUDA graph captures (engine/prefill_graph.py), run eagerly here:
    image rows injected into its static input, chunks cut at snapshot positions, greedy tokens
    equal to transformers' for an image question and a follow-up turn."""
    from deltaserve import LLM
    from deltaserve.engine.prefill_graph import PrefillGraphs

    llm = LLM(minicpm_dir, dtype="float32", max_num_batched_tokens=64)
    runner, cache = llm.engine.runner, llm.engine.cache
    graphs = runner.prefill_graphs = PrefillGraphs(runner.model, cache, cache.spare_slot,
                                                   cache.spare_block, runner.greedy_head)
    image = picture(300, 500, seed=2)
    content = [{"type": "image", "image": image}, {"type": "text", "text": "What is it?"}]
    first = llm.generate(chat(llm, content), GREEDY)[0]
    expected, _ = reference_greedy(reference, first.prompt_token_ids, [image], 10)
    assert first.outputs[0].token_ids == expected
    assert any(key[2] for key in graphs.graphs)  # a step with image rows took the padded step
    history = [{"role": "user", "content": content},
               {"role": "assistant", "content": first.outputs[0].text}]
    follow = llm.generate(chat(llm, "Why?", history), GREEDY)[0]
    expected, _ = reference_greedy(reference, follow.prompt_token_ids, [image], 10)
    assert follow.outputs[0].token_ids == expected
    assert graphs.num_runs >= 3


@pytest.mark.gpu
def test_image_prompt_graphs_on_cuda(minicpm_dir) -> None:
    """bf16 on CUDA: image questions replayed from captured prefill graphs (image rows through
    the static embeddings buffer, chunks cut at snapshot positions) against the eager engine."""
    from deltaserve import LLM

    llm = LLM(minicpm_dir, dtype="bfloat16", device="cuda", max_num_batched_tokens=64)
    graphs = llm.engine.runner.prefill_graphs
    assert graphs is not None
    image = picture(300, 500, seed=2)
    prompt = chat(llm, [{"type": "image", "image": image}, {"type": "text", "text": "What?"}])
    with_graphs = our_first_logits(llm, prompt)
    assert any(key[2] for key in graphs.graphs)
    # another engine, so that the eager run computes every row itself (no prefix-cache hit on
    # the snapshot the graph run stored)
    eager_llm = LLM(minicpm_dir, dtype="bfloat16", device="cuda", max_num_batched_tokens=64)
    eager_llm.engine.runner.prefill_graphs = None
    eager = our_first_logits(eager_llm, chat(eager_llm, [{"type": "image", "image": image},
                                                         {"type": "text", "text": "What?"}]))
    err = rel_l2(with_graphs.float(), eager.float())
    print(f"image prompt, graph vs eager first logits rel {err:.2e}")
    assert err < 2e-2


def test_4x_mode_matches_transformers(llm, reference) -> None:
    image = picture(300, 400, seed=4)
    prompt = chat(llm, [{"type": "image", "image": image}, {"type": "text", "text": "Describe."}])
    prompt["mm_processor_kwargs"] = {"downsample_mode": "4x"}
    out = llm.generate(prompt, GREEDY)[0]
    assert out.prompt_token_ids.count(248056) == process_image(image, "4x").total_tokens
    expected, _ = reference_greedy(reference, out.prompt_token_ids, [image], 10, "4x")
    assert out.outputs[0].token_ids == expected


def test_prefix_cache_is_keyed_by_image_content(minicpm_dir) -> None:
    """Two same-size images share every token id; a snapshot taken inside the first image's
    placeholders must not serve the second. The same image again does hit."""
    from deltaserve import LLM

    cached = LLM(minicpm_dir, dtype="float32")
    fresh = LLM(minicpm_dir, dtype="float32", prefix_cache_bytes=0)
    question = [{"type": "text", "text": "What is in the picture?"}]
    a, b = (chat(cached, [{"type": "image", "image": picture(300, 500, seed=s)}, *question])
            for s in (5, 6))
    out_a = cached.generate(a, GREEDY)[0]
    hits = cached.engine.cache.prefix.hits
    out_b = cached.generate(b, GREEDY)[0]
    assert out_a.prompt_token_ids == out_b.prompt_token_ids  # same ids, different pixels
    assert cached.engine.cache.prefix.hits == hits  # no snapshot inside image a reused for b
    assert out_b.outputs[0].token_ids == fresh.generate(b, GREEDY)[0].outputs[0].token_ids
    again = cached.generate(a, GREEDY)[0]
    assert cached.engine.cache.prefix.hits == hits + 1
    assert again.outputs[0].token_ids == out_a.outputs[0].token_ids


def test_bad_image_requests_are_refused_before_running(llm, tiny_llm, tmp_path) -> None:
    image = picture(64, 64, seed=7)
    one = [{"type": "image", "image": image}, {"type": "text", "text": "?"}]
    with pytest.raises(RequestError, match="takes no images"):
        tiny_llm.generate({"prompt": IMAGE_PAD, "multi_modal_data": {"image": image}})
    with pytest.raises(RequestError, match="placeholders"):
        llm.generate({"prompt": "no placeholder", "multi_modal_data": {"image": image}})
    with pytest.raises(RequestError, match="limit is 8"):
        llm.generate(chat(llm, one * 9))
    with pytest.raises(RequestError, match="not fetched"):
        llm.generate(chat(llm, [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]))
    with pytest.raises(RequestError, match="not found"):
        llm.generate(chat(llm, [{"type": "image", "image": str(tmp_path / "missing.png")}]))
    with pytest.raises(RequestError, match="cannot read"):
        llm.generate(chat(llm, [{"type": "image", "image": "x" * 5000}]))  # name too long
    (tmp_path / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)
    with pytest.raises(RequestError):
        llm.generate(chat(llm, [{"type": "image", "image": str(tmp_path / "bad.png")}]))
    small = type(llm)(llm.model_dir, dtype="float32", max_model_len=48)
    with pytest.raises(RequestError, match="context limit"):
        small.generate(chat(small, one))
    assert not llm.engine.scheduler.has_work  # nothing was admitted


def test_tower_outputs_are_reused_by_image_content(llm) -> None:
    """A chat re-sends its earlier images every turn: the tower runs once per distinct image
    (by content), and the answers are the same as when it ran."""
    images = llm.images
    first, second = picture(300, 500, seed=9), picture(300, 500, seed=10)
    ask = [{"type": "image", "image": first}, {"type": "text", "text": "Describe."}]
    before = images.num_tower_images
    out = llm.generate(chat(llm, ask), GREEDY)[0]
    assert images.num_tower_images == before + 1
    again = llm.generate(chat(llm, ask), GREEDY)[0]
    assert images.num_tower_images == before + 1  # same pixels: no tower run
    assert again.outputs[0].token_ids == out.outputs[0].token_ids
    history = [{"role": "user", "content": ask},
               {"role": "assistant", "content": out.outputs[0].text}]
    llm.generate(chat(llm, [{"type": "image", "image": second},
                            {"type": "text", "text": "And this?"}], history), GREEDY)
    assert images.num_tower_images == before + 2  # only the new image went through the tower
    budget = images.cache_bytes
    images.cache_bytes = 1  # nothing fits: every request runs the tower again
    try:
        llm.generate(chat(llm, [{"type": "image", "image": picture(200, 200, seed=11)},
                                {"type": "text", "text": "?"}]), GREEDY)
        llm.generate(chat(llm, [{"type": "image", "image": picture(200, 200, seed=11)},
                                {"type": "text", "text": "?"}]), GREEDY)
        assert images.num_tower_images == before + 4
    finally:
        images.cache_bytes = budget
