"""vLLM's and llama-server's flags on our command line: each alias reaches the engine option it
names, each flag without meaning here is refused in one line under the subcommand's usage, and
parsing never imports torch."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from deltaserve.cli import main, parse
from deltaserve.cli_serve import REFUSED
from deltaserve.engine.args import EngineArgs
from deltaserve.errors import ConfigError


def _refused(capsys, *argv: str) -> str:
    """The one error line of a parse that must fail (exit 2, the subcommand's usage)."""
    with pytest.raises(SystemExit) as exc:
        parse(list(argv))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: deltaserve {argv[0]}")
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and lines[0].startswith(f"deltaserve {argv[0]}: error: ")
    return lines[0]


def test_vllm_and_llama_server_spellings_reach_the_engine_options() -> None:
    args = parse(["serve", "some/model", "--served-model-name", "a", "b", "--alias", "c",
                  "--alias", "a", "-np", "3", "-c", "1024", "-t", "2", "--dtype", "half",
                  "--kv-cache-dtype", "bf16", "--no-enable-prefix-caching", "-q", "int8",
                  "--jinja", "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder",
                  "--reasoning-parser", "qwen3", "--tensor-parallel-size", "1",
                  "--pipeline-parallel-size", "1", "--generation-config", "vllm",
                  "--seed", "7", "--max-num-batched-tokens", "256", "--metrics",
                  "--metrics-without-key"])
    assert args.model == "some/model" and args.served_model_names == ["a", "b", "c"]
    assert args.metrics_without_key and not parse(["serve", "m"]).metrics_without_key
    assert (args.quant, args.threads, args.seed) == ("int8", 2, 7)
    engine = EngineArgs.from_cli_args(args)
    assert (engine.model, engine.dtype, engine.kv_cache_dtype) == ("some/model", "float16",
                                                                   "bfloat16")
    assert (engine.max_num_seqs, engine.max_model_len, engine.max_num_batched_tokens) == (3, 1024,
                                                                                          256)
    assert engine.prefix_cache_bytes == 0 and engine.generation_config == "vllm"
    default = EngineArgs.from_cli_args(parse(["serve", "--enable-prefix-caching",
                                              "--dtype", "bf16", "--parallel", "5",
                                              "--ctx-size", "64"]))
    assert default.prefix_cache_bytes == EngineArgs().prefix_cache_bytes > 0
    assert (default.dtype, default.max_num_seqs, default.max_model_len) == ("bfloat16", 5, 64)
    for command in ("generate", "bench", "validate"):  # the engine flags are everyone's
        one = EngineArgs.from_cli_args(parse([command, "-m", "x", "--dtype", "fp32", "-c", "32"]))
        assert (one.model, one.dtype, one.max_model_len) == ("x", "float32", 32)


@pytest.mark.parametrize("flags", sorted(REFUSED), ids=lambda f: f[0])
def test_peer_flags_without_meaning_are_refused_with_their_reason(capsys, flags) -> None:
    for flag in flags:
        line = _refused(capsys, "serve", flag, "1")
        assert f"{flag} is not supported: {REFUSED[flags]}" in line


@pytest.mark.parametrize("argv, reason", [
    (["--kv-cache-dtype", "fp8_e5m2"], "fp8 KV caches are not supported"),
    (["--dtype", "int8"], "'int8' is not a dtype here"),
    (["-q", "awq"], "--quantization must be one of int8, int4, q1"),
    (["--tool-call-parser", "hermes"], "hermes' JSON calls are not its format"),
    (["--reasoning-parser", "granite"], "--reasoning-parser must be one of qwen3, deepseek_r1"),
    (["--pipeline-parallel-size", "2"], "serve runs tensor parallelism only"),
    (["m1", "--model", "m2"], "the model is given twice"),
    (["--served-model-name", " "], "a name is empty"),
    (["--threads", "0"], "--threads must be at least 1"),
    (["--bogus-flag"], "unrecognized arguments: --bogus-flag"),
])
def test_serve_mistakes_are_one_line_under_the_serve_usage(capsys, argv, reason) -> None:
    assert reason in _refused(capsys, "serve", *argv)


def test_a_bad_flag_of_any_subcommand_prints_that_subcommand_usage(capsys) -> None:
    assert "unrecognized arguments: --nope" in _refused(capsys, "generate", "--nope")
    assert "unrecognized arguments: --nope" in _refused(capsys, "bench", "--nope")


def test_engine_values_refused_before_anything_loads(capsys, tmp_path) -> None:
    with pytest.raises(ConfigError, match="applies to CUDA devices"):
        EngineArgs(gpu_memory_utilization=0.9)
    with pytest.raises(ConfigError, match=r"must be in \(0, 1\]"):
        EngineArgs(device="cuda", gpu_memory_utilization=1.5)
    with pytest.raises(ConfigError, match="holding a generation_config.json"):
        EngineArgs(generation_config=str(tmp_path))
    rc = main(["serve", "--gpu-memory-utilization", "0.9", "--port", "1"])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "applies to CUDA devices" in err


def test_parsing_and_help_import_no_torch() -> None:
    code = ("import sys; from deltaserve.cli import parse; "
            "parse(['serve', 'm', '--dtype', 'half', '-np', '2']); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    version = subprocess.run([sys.executable, "-m", "deltaserve", "--version"],
                             capture_output=True, text=True, check=True)
    from deltaserve import __version__

    assert version.stdout.strip() == f"deltaserve {__version__}"


def test_startup_failures_are_one_line_and_exit_1(capsys, tiny_dir) -> None:
    import torch

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        rc = main(["serve", str(tiny_dir), "--port", str(port)])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1
    assert f"cannot listen on 127.0.0.1:{port}" in err
    bad = ["tpu", "not a device!"] + ([] if torch.cuda.is_available() else ["cuda", "cuda:1"])
    for device in bad:
        assert main(["serve", str(tiny_dir), "--device", device]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("deltaserve: error: --device"), err
    assert main(["serve", str(tiny_dir), "--chat-template", "{% for m in messages %}"]) == 1
    assert "the template does not compile" in capsys.readouterr().err
    assert main(["serve", str(tiny_dir), "--chat-template", "no/such/file.jinja"]) == 1
    assert "no such file" in capsys.readouterr().err
