"""`--device vulkan` through the engine: greedy tokens identical to the CPU fp32 path on the tiny
preset and on a non-preset config (Hv = 3 Hk, untied head, other layer count), one prompt and a
batch, cold and from prefix-cache hits; what the backend does not run is refused before loading."""

from __future__ import annotations

import pytest
import torch

from deltaserve.errors import ConfigError
from deltaserve.vulkan import device as vkdev
from tests.conftest import write_variant

pytestmark = pytest.mark.skipif(not vkdev.available(), reason=vkdev.adapter_or_reason()[1])

PROMPTS = ["The quick brown fox", " ".join(str(i) for i in range(70))]  # 2nd: past a 64-grid


def tokens(llm, prompts, n=6):
    from deltaserve.engine.sampling import SamplingParams

    out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n))
    return [list(o.outputs[0].token_ids) for o in out]


@pytest.fixture(scope="module")
def variant_dir(tmp_path_factory):
    types = ["linear_attention"] * 3 + ["full_attention"]
    return write_variant(tmp_path_factory.mktemp("vk-variant"), seed=3, num_hidden_layers=4,
                         layer_types=types, linear_num_value_heads=6, tie_word_embeddings=False)


@pytest.mark.parametrize("which", ["tiny", "variant"])
def test_greedy_tokens_equal_the_cpu_fp32_path(which, tiny_dir, variant_dir) -> None:
    from deltaserve import LLM

    path = tiny_dir if which == "tiny" else variant_dir
    cpu, vk = LLM(path, dtype="float32"), LLM(path, device="vulkan")
    want = tokens(cpu, PROMPTS)
    assert [tokens(vk, [p])[0] for p in PROMPTS] == want  # one at a time
    assert tokens(vk, PROMPTS) == want  # batched: a decode row beside a prefill chunk
    if which == "variant":  # a step over max_rows: every chunk in pieces of 5 rows
        vk.model.vulkan.max_rows = lambda: 5
        assert tokens(vk, PROMPTS) == want
        del vk.model.vulkan.max_rows
    prefix = vk.engine.cache.prefix
    assert prefix.nbytes > 0  # the long prompt's snapshot, read back from the GPU
    hits = prefix.hits
    longer = [PROMPTS[1] + " 70 71"]
    assert tokens(vk, longer) == tokens(cpu, longer)  # restored from that snapshot
    assert prefix.hits > hits


def test_what_vulkan_does_not_run_is_refused_before_loading(tiny_dir) -> None:
    from deltaserve import LLM

    with pytest.raises(ConfigError, match="pass --dtype float16"):
        LLM(tiny_dir, device="vulkan", dtype="bfloat16")
    with pytest.raises(ConfigError, match="speculative"):
        LLM(tiny_dir, device="vulkan", speculative_config={"method": "ngram",
                                                           "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="--device vulkan"):
        LLM(tiny_dir, gpu_memory_limit_gb=4)


def test_the_memory_limit_refuses_a_plan_over_it(tiny_dir) -> None:
    from deltaserve import LLM

    with pytest.raises(ConfigError, match="over --gpu-memory-limit"):
        LLM(tiny_dir, device="vulkan", gpu_memory_limit_gb=0.05)  # the head alone is 0.12 GiB


def test_the_kv_cache_is_sized_within_the_memory_limit(tiny_dir) -> None:
    from deltaserve import LLM

    vk = LLM(tiny_dir, device="vulkan", gpu_memory_limit_gb=0.5)
    assert tokens(vk, PROMPTS[:1], n=2)  # runs within it
    report, dev = vk.engine.memory_report, vk.model.vulkan.dev
    assert report.device.startswith("vulkan: ")
    assert dev.allocated <= dev.memory_limit and report.headroom_bytes > 0
    assert 0 < report.kv_capacity_tokens < 2**18  # less than the 4 GiB host plan's 262k tokens


def test_teacher_forced_logits_through_sequence(tiny_dir) -> None:
    """cache/sequence (validate's, the gate's and echo scoring's path) runs on the Vulkan pools:
    every position's logits against the CPU fp32 path."""
    from deltaserve import LLM
    from deltaserve.cache.sequence import Sequence, prompt_logits

    cpu, vk = LLM(tiny_dir, dtype="float32"), LLM(tiny_dir, device="vulkan")
    ids = cpu.tokenizer.encode(PROMPTS[1])
    want, got = prompt_logits(cpu.model, ids), prompt_logits(vk.model, ids)
    assert got.shape == want.shape
    assert ((got - want).norm() / want.norm()).item() < 1e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    with pytest.raises(ConfigError, match="hidden states"):
        Sequence(vk.model, 4).hidden([1, 2])
    # a step over max_rows runs in pieces (each chunk's rows in order), same logits
    vk.model.vulkan.max_rows = lambda: 7
    pieces = prompt_logits(vk.model, ids)
    assert ((pieces - want).norm() / want.norm()).item() < 1e-4


def test_prefix_snapshots_export_and_import_through_gpu_pools(tiny_dir, tmp_path) -> None:
    from deltaserve import LLM
    from deltaserve.cache.snapshot_io import export_snapshots, import_snapshots

    a = LLM(tiny_dir, device="vulkan")
    want = tokens(a, PROMPTS[1:])
    assert export_snapshots(a.engine.cache.prefix, tmp_path / "snaps.safetensors") > 0
    b = LLM(tiny_dir, device="vulkan")
    prefix = b.engine.cache.prefix
    assert import_snapshots(prefix, tmp_path / "snaps.safetensors") > 0
    assert tokens(b, PROMPTS[1:]) == want and prefix.hits == 1  # from the imported state


def test_float16_weights_against_the_cpu_fp32_path(tiny_dir) -> None:
    """--dtype float16: the dense matrices held as f16 (half the bytes), the logits within f16
    rounding of the fp32 path's, the same greedy tokens at the first position of each prompt."""
    from deltaserve import LLM
    from deltaserve.cache.sequence import prompt_logits

    cpu, f32 = LLM(tiny_dir, dtype="float32"), LLM(tiny_dir, device="vulkan")
    f16 = LLM(tiny_dir, device="vulkan", dtype="float16")
    kinds = {w.kind for layer in f16.model.vulkan.layers for w in layer.values()
             if hasattr(w, "kind")}
    assert kinds == {"f16"} and f16.model.vulkan.embed.kind == "f16"
    assert f16.model.vulkan.weights_bytes < 0.55 * f32.model.vulkan.weights_bytes
    ids = cpu.tokenizer.encode(PROMPTS[1])
    want, got = prompt_logits(cpu.model, ids), prompt_logits(f16.model, ids)
    err = ((got - want).norm() / want.norm()).item()
    assert 1e-6 < err < 1e-2  # rounded, not exact
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


def test_greedy_head_tokens_from_the_gpu_argmax(tiny_dir) -> None:
    """greedy_head: the tokens are the GPU's argmax (no logits read back), one prompt and
    batched, through a chunk cut at its prefix snapshots; equal to the CPU fp32 path's."""
    from deltaserve import LLM

    cpu, vk = LLM(tiny_dir, dtype="float32"), LLM(tiny_dir, device="vulkan", greedy_head=True)
    want = tokens(cpu, PROMPTS)
    assert [tokens(vk, [p])[0] for p in PROMPTS] == want
    assert tokens(vk, PROMPTS) == want
    assert vk.engine.cache.prefix.nbytes > 0


def test_minicpm_v_on_vulkan_runs_text_and_refuses_images(tmp_path) -> None:
    """The vision tower does not run on --device vulkan: an image request is refused with the
    reason (not a failed step), and the same engine goes on with text."""
    from deltaserve import LLM
    from deltaserve.checkpoint.presets import preset
    from deltaserve.checkpoint.writer import write_checkpoint
    from deltaserve.errors import RequestError

    write_checkpoint(preset("minicpm-v-tiny"), tmp_path, 0)
    cpu, vk = LLM(tmp_path, dtype="float32"), LLM(tmp_path, device="vulkan")
    image = {"prompt": "(<image>./</image>) what is it?",
             "multi_modal_data": {"image": "data:image/png;base64,AAAA"}}
    with pytest.raises(RequestError, match="vision tower"):
        vk.generate(image)
    assert tokens(vk, PROMPTS[:1], n=3) == tokens(cpu, PROMPTS[:1], n=3)


def test_serve_takes_device_vulkan() -> None:
    """`deltaserve serve --device vulkan` passes the server's device check (it refused it as a
    torch device type before); the other device checks stand."""
    from deltaserve.server.main import check_device

    check_device("vulkan")
    with pytest.raises(ConfigError, match="cpu, cuda and vulkan"):
        check_device("mps")


def test_the_profile_times_every_dispatch_without_changing_the_tokens(tiny_dir) -> None:
    """dev.profile: each dispatch its own timed pass, labelled `section:kernel`; the tokens are
    the unprofiled ones and every dispatch of the steps is counted."""
    from deltaserve import LLM

    vk = LLM(tiny_dir, device="vulkan")
    dev = vk.model.vulkan.dev
    if "timestamp-query" not in dev.features:
        pytest.skip(f"{dev.name} has no timestamp queries")
    want = tokens(vk, PROMPTS[:1])
    dev.profile(True)
    assert tokens(vk, PROMPTS[:1]) == want
    rep = dev.profile(False)
    assert dev.profiler is None and rep["_"]["steps"] == 6  # a prefill and five decode steps
    layers = vk.model.cfg.num_hidden_layers
    gdn = sum(t != "full_attention" for t in vk.model.cfg.layer_types)
    assert rep["gdn:gdn_delta"]["dispatches"] == 6 * gdn
    assert rep["attn:attend"]["dispatches"] == 6 * (layers - gdn)
    assert rep["head:qgemv"]["dispatches"] >= 6
    assert all(v["ms"] >= 0 for v in rep.values()) and rep["_"]["ms"] > 0
    assert sum(v["dispatches"] for k, v in rep.items() if k != "_") == rep["_"]["dispatches"]


def test_decode_steps_replay_their_recorded_plan(tiny_dir, monkeypatch) -> None:
    """A step layout seen before is replayed from its recorded dispatches (not recorded again);
    the tokens are those of recording every step (the CPU fp32 path's)."""
    from deltaserve import LLM
    from deltaserve.vulkan import device

    cpu, vk = LLM(tiny_dir, dtype="float32"), LLM(tiny_dir, device="vulkan")
    replays = []
    real = device.Recorder.replay
    monkeypatch.setattr(device.Recorder, "replay",
                        lambda self, ops: (replays.append(len(ops)), real(self, ops)))
    want = tokens(cpu, PROMPTS, n=12)
    assert tokens(vk, PROMPTS, n=12) == want
    assert len(replays) >= 8 and min(replays) > 20  # decode steps of both rows replayed whole
    vk.model.vulkan._plans.clear()
    replays.clear()
    dev = vk.model.vulkan.dev
    dev.generation += 1  # as a freed buffer does: every kept plan is stale
    assert tokens(vk, PROMPTS, n=12) == want
