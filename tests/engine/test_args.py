"""EngineArgs: one set of engine options for LLM, the command line and serve."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest

from deltaserve import LLM, EngineArgs
from deltaserve.cli import build_parser, parse
from deltaserve.engine.args import CLI_GROUPS
from deltaserve.errors import ConfigError, RequestError
from deltaserve.multimodal.inputs import ImageLimits
from deltaserve.spec.config import SpeculativeConfig

# each group's non-default flags, and the fields they set
FLAGS = {
    "model": (["--model", "some/dir", "--dtype", "float16", "--device", "cuda:1",
               "--max-model-len", "512"],
              dict(model="some/dir", dtype="float16", device="cuda:1", max_model_len=512)),
    "tp": (["--tensor-parallel-size", "2"], dict(tensor_parallel_size=2)),
    "pp": (["--pp", "2", "--pp-layers", "3,5"],
           dict(pipeline_parallel_size=2, layer_split=(3, 5))),
    "speculative": (["--speculative", "ngram", "--num-speculative-tokens", "3",
                     "--speculative-config", '{"prompt_lookup_max": 5}'],
                    dict(speculative_config=SpeculativeConfig(
                        method="ngram", num_speculative_tokens=3, prompt_lookup_max=5))),
    "batching": (["--max-num-seqs", "8", "--max-num-batched-tokens", "1024", "--max-queue", "12",
                  "--prefix-snapshots", "grid", "--kv-cache-dtype", "bfloat16"],
                 dict(max_num_seqs=8, max_num_batched_tokens=1024, max_waiting=12,
                      prefix_snapshots="grid", kv_cache_dtype="bfloat16")),
    "images": (["--max-images", "3", "--max-visual-tokens", "640", "--max-image-mb", "1.5",
                "--max-image-mpx", "2"],
               dict(image_limits=ImageLimits(max_images=3, max_image_bytes=int(1.5 * 2**20),
                                             max_image_pixels=2_000_000, max_visual_tokens=640))),
}
# the engine flag groups of each command, and its --dtype default
COMMANDS = {
    "generate": (("model", "tp", "pp", "speculative"), "auto"),
    "chat": (("model",), "auto"),
    "validate": (("model",), "float32"),
    "bench": (("model", "tp", "pp"), "auto"),
    "serve": (("model", "tp", "speculative", "batching", "images"), "auto"),
    "gate": (("model",), "float32"),
    "needle": (("model",), "float32"),
}


def _parse(groups, argv: list[str]) -> EngineArgs:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser(), groups)
    return EngineArgs.from_cli_args(parser.parse_args(argv))


def _flags(groups) -> tuple[list[str], dict]:
    argv, fields = [], {}
    for g in groups:
        argv += FLAGS[g][0]
        fields.update(FLAGS[g][1])
    return argv, fields


def test_defaults_round_trip() -> None:
    assert _parse(CLI_GROUPS, []) == EngineArgs()


@pytest.mark.parametrize("groups", [("model", "tp", "speculative", "batching", "images"),
                                    ("model", "pp")], ids=["tp-serve", "pp"])
def test_non_defaults_round_trip(groups) -> None:
    argv, fields = _flags(groups)
    assert _parse(groups, argv) == EngineArgs(**fields)


def test_cli_spellings() -> None:
    """vLLM's long spellings and ours mean the same; --tp 1 leaves the size to the launch."""
    assert _parse(("tp", "pp"), ["--tp", "2"]) == _parse(("tp",), ["--tensor-parallel-size", "2"])
    assert _parse(("pp",), ["--pipeline-parallel-size", "2"]).pipeline_parallel_size == 2
    assert _parse(("tp",), ["--tp", "1"]).tensor_parallel_size is None


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_takes_its_engine_flags_the_same_way(command) -> None:
    groups, dtype_default = COMMANDS[command]
    argv, fields = _flags(groups)
    parser = build_parser()
    assert EngineArgs.from_cli_args(parser.parse_args([command, *argv])) == EngineArgs(**fields)
    defaults = EngineArgs.from_cli_args(parser.parse_args([command]))
    assert defaults == EngineArgs(dtype=dtype_default)
    # and no other group's flags: a command does not take options it ignores (serve names
    # --pipeline-parallel-size only to refuse it with the reason)
    for other in set(CLI_GROUPS) - set(groups):
        with pytest.raises(SystemExit):
            parse([command, FLAGS[other][0][0], FLAGS[other][0][1]])


def test_bad_values_fail_before_any_model_loads(capsys) -> None:
    with pytest.raises(RequestError, match="kv_cache_dtype must be one of"):
        EngineArgs(kv_cache_dtype="int3")
    with pytest.raises(RequestError, match="prefix_snapshots must be one of"):
        EngineArgs(prefix_snapshots="dense")
    with pytest.raises(ConfigError, match="'mtp' is not supported with pipeline"):
        EngineArgs(pipeline_parallel_size=2, speculative_config={"method": "mtp"})
    with pytest.raises(ConfigError, match="must be positive"):
        _parse(("images",), ["--max-images", "0"])
    with pytest.raises(RequestError, match="speculative method must be one of"):
        _parse(("speculative",), ["--speculative-config", '{"method": "eagle"}'])
    with pytest.raises(TypeError):
        EngineArgs("positional/model")  # keyword-only: no positional magic


def test_looser_forms_are_stored_as_one_type() -> None:
    args = EngineArgs(speculative_config={"method": "ngram"}, layer_split=[3, 5],
                      image_limits=None)
    assert args.speculative_config == SpeculativeConfig(method="ngram")
    assert args.layer_split == (3, 5)
    assert args.image_limits == ImageLimits()


OLD_KWARGS = dict(dtype="float32", max_model_len=200, max_num_seqs=3, max_num_batched_tokens=96,
                  prefix_cache_bytes=0, prefix_snapshots="grid", kv_cache_bytes=1 << 24,
                  kv_cache_dtype="bfloat16", max_waiting=5, tensor_parallel_size=1,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_llm_keywords_equal_engine_args(tiny_dir) -> None:
    old = LLM(tiny_dir, **OLD_KWARGS)
    args = EngineArgs(model=tiny_dir, **OLD_KWARGS)
    new = LLM(engine_args=args)
    assert old.engine_args == new.engine_args == args
    assert LLM.from_engine_args(args).engine_args == args
    a, b = old.engine.config, new.engine.config
    assert a == b
    assert (a.scheduler.max_num_seqs, a.scheduler.max_num_batched_tokens,
            a.scheduler.max_waiting) == (3, 96, 5)
    assert (a.cache.num_slots, a.cache.prefix_budget_bytes, a.cache.prefix_snapshots) == (
        3, 0, "grid")
    assert a.speculative == SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    assert old.max_model_len == 200


def test_llm_refuses_unknown_and_mixed_arguments(tiny_dir) -> None:
    with pytest.raises(TypeError, match="max_num_sequences"):
        LLM(tiny_dir, max_num_sequences=4)
    with pytest.raises(TypeError, match="not both"):
        LLM(tiny_dir, engine_args=EngineArgs(model=tiny_dir))
    with pytest.raises(TypeError, match="not both"):
        LLM(engine_args=EngineArgs(model=tiny_dir), dtype="float32")


def test_engine_cache_uses_the_named_block_constants(tiny_llm) -> None:
    from deltaserve.cache.manager import KV_BLOCK_LEN, PREFIX_GRANULARITY

    engine = tiny_llm.engine
    assert engine.config.cache.block_len == KV_BLOCK_LEN
    assert engine.config.cache.prefix_granularity == PREFIX_GRANULARITY
    assert engine.config.cache.prefix_budget_bytes == tiny_llm.engine_args.prefix_cache_bytes
    assert replace(tiny_llm.engine_args, max_num_seqs=2).max_num_seqs == 2


def test_generation_config_choices(tiny_dir, tmp_path) -> None:
    """auto: the checkpoint's sampling defaults; vllm: none (its eos ids kept); a folder: its."""
    import json

    from deltaserve import LLM, SamplingParams

    auto = LLM(tiny_dir, dtype="float32")
    assert auto.get_default_sampling_params().top_k > 0  # the preset's Qwen defaults
    plain = LLM(tiny_dir, dtype="float32", generation_config="vllm")
    blank = SamplingParams()
    got = plain.get_default_sampling_params()
    assert (got.temperature, got.top_k, got.top_p) == (blank.temperature, 0, blank.top_p)
    assert plain.eos_token_ids == auto.eos_token_ids
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.3, "top_k": 7}))
    other = LLM(tiny_dir, dtype="float32", generation_config=str(tmp_path))
    got = other.get_default_sampling_params()
    assert (got.temperature, got.top_k) == (0.3, 7)


def test_gpu_memory_share_is_what_the_card_has_left_of_it(monkeypatch) -> None:
    import torch

    from deltaserve.cache.memory import available_bytes

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * gib, 80 * gib))
    cuda = torch.device("cuda")
    assert available_bytes(cuda) == 30 * gib
    assert available_bytes(cuda, 0.9) == 72 * gib - 50 * gib  # 90% of 80 minus the 50 held
    assert available_bytes(cuda, 0.5) == 0  # already over the share
