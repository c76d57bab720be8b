"""The command line end to end: generate (text and --json), chat, make-checkpoint, validate, bench."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from deltaserve import SamplingParams
from deltaserve.cli import main


def _cli(*argv: str, input: str | None = None) -> subprocess.CompletedProcess:
    """The real entry point in a fresh process, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "deltaserve", *argv], input=input, capture_output=True, text=True
    )


def test_generate_json_matches_the_api(capsys, tiny_dir, tiny_llm) -> None:
    rc = main(
        [
            "generate",
            "--model",
            str(tiny_dir),
            "--dtype",
            "float32",
            "-p",
            "The cat",
            "--max-tokens",
            "6",
            "--temperature",
            "0",
            "--ignore-eos",
            "--json",
        ]
    )
    out = capsys.readouterr()
    assert rc == 0
    record = json.loads(out.out)
    expected = tiny_llm.generate(
        "The cat", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    )[0]
    assert record["token_ids"] == expected.outputs[0].token_ids
    assert record["prompt_token_ids"] == expected.prompt_token_ids
    assert record["timings"]["num_generated_tokens"] == 6
    assert "tokens-per-sec" in out.err


def test_generate_stdout_carries_only_the_text(tiny_dir, tiny_llm) -> None:
    proc = _cli(
        "generate",
        "--model",
        str(tiny_dir),
        "--dtype",
        "float32",
        "-p",
        "Hi",
        "--max-tokens",
        "5",
        "--temperature",
        "0",
        "--ignore-eos",
    )
    assert proc.returncode == 0, proc.stderr
    expected = tiny_llm.generate(
        "Hi", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    )[0]
    assert proc.stdout == expected.outputs[0].text + "\n"
    assert "Generation: 5 tokens" in proc.stderr


def test_generate_reads_prompt_from_stdin(tiny_dir) -> None:
    proc = _cli(
        "generate",
        "--model",
        str(tiny_dir),
        "--max-tokens",
        "3",
        "--temperature",
        "0",
        "--json",
        input="Hello there",
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["prompt"] == "Hello there"


def test_chat_reads_turns_from_stdin(tiny_dir) -> None:
    proc = _cli(
        "chat",
        "--model",
        str(tiny_dir),
        "--max-tokens",
        "4",
        "--temperature",
        "0",
        "--no-think",
        "--system",
        "Be brief.",
        input="hello\nsecond turn\n/exit\n",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("tok/s]") == 2  # two replies
    assert len(proc.stdout.splitlines()) == 2


def test_make_checkpoint_dry_run_27b(capsys) -> None:
    assert main(["make-checkpoint", "--preset", "qwen3.5-27b", "--dry-run"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_tensors"] == 1199 and summary["num_bytes"] == 55_562_872_800
    assert summary["matches_published"] is True


def test_make_checkpoint_refuses_a_non_empty_folder(capsys, tiny_dir) -> None:
    assert main(["make-checkpoint", "--preset", "tiny", str(tiny_dir)]) == 1
    assert "not empty" in capsys.readouterr().err


def test_validate_passes_and_fails(capsys, tiny_dir) -> None:
    assert (
        main(["validate", "--model", str(tiny_dir), "--prompt-len", "40", "--num-tokens", "8"]) == 0
    )
    out = capsys.readouterr().out
    assert "greedy tokens: 8/8 identical ok" in out
    # an impossible tolerance must fail with a non-zero status
    assert (
        main(
            [
                "validate",
                "--model",
                str(tiny_dir),
                "--prompt-len",
                "40",
                "--num-tokens",
                "4",
                "--tolerance",
                "1e-30",
            ]
        )
        == 3
    )
    assert "FAIL" in capsys.readouterr().out


def test_bench_writes_a_traceable_record(capsys, tiny_dir, tmp_path) -> None:
    out_file = tmp_path / "bench.json"
    rc = main(
        [
            "bench",
            "--model",
            str(tiny_dir),
            "--prefill-lens",
            "64",
            "--decode-tokens",
            "8",
            "--repeats",
            "1",
            "--out",
            str(out_file),
        ]
    )
    assert rc == 0
    record = json.loads(out_file.read_text())
    assert set(record["engines"]) == {"deltaserve", "transformers"}
    for engine in record["engines"].values():
        assert (
            engine["prefill_64_tok_s"] > 0
            and engine["decode_tok_s"] > 0
            and engine["peak_rss_gb"] > 0
        )
    assert len(record["checkpoint_fingerprint"]) == 16 and record["git_commit"]
    assert record["dtype"] == "bfloat16" and "name" in record["device"]
    ours = record["engines"]["deltaserve"]  # the memory roofline beside the decode rate
    assert ours["bytes_per_token"] > 0 and record["memory_read_gbs"] > 0
    assert ours["roofline_pct"] == pytest.approx(100 * ours["decode_tok_s"] * ours[
        "bytes_per_token"] / (record["memory_read_gbs"] * 1e9))


def test_bench_runs_on_the_default_model(tmp_path) -> None:
    """Its vocabulary (8,192) is far smaller than Qwen3.5's: prompts must come from it."""
    out_file = tmp_path / "bench.json"
    assert main(["bench", "--prefill-lens", "32", "--decode-tokens", "4", "--repeats", "1",
                 "--peer", "none", "--out", str(out_file)]) == 0
    assert json.loads(out_file.read_text())["engines"]["deltaserve"]["decode_tok_s"] > 0


def test_default_model_is_the_shipped_trained_one(capsys) -> None:
    prompt = "import os\n\n\ndef list_python_files(path):\n"
    assert main(["generate", "-p", prompt, "--max-tokens", "24", "--temperature", "0"]) == 0
    captured = capsys.readouterr()
    assert "stdlib-19m" in captured.err and "tokens-per-sec" in captured.err
    # a trained model continues a def with an indented body; random weights would not
    assert captured.out.startswith("    ") and len(captured.out.strip()) > 20


def test_generate_json_schema_and_penalties(capsys, tmp_path) -> None:
    """--json-schema FILE constrains the output (the embedded default model); a file that is not
    a schema is one error line; the penalties flags reach the sampler."""
    import jsonschema

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "n": {"type": "integer"}}, "required": ["name", "n"]}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    (tmp_path / "bad.json").write_text("{bad")
    base = ["generate", "-p", "config = ", "--max-tokens", "100", "--temperature", "0"]
    assert main([*base, "--json-schema", str(tmp_path / "s.json")]) == 0
    jsonschema.validate(json.loads(capsys.readouterr().out), schema)
    assert main([*base, "--json-schema", str(tmp_path / "bad.json")]) != 0
    assert "the JSON schema is not valid JSON" in capsys.readouterr().err
    assert main([*base, "--max-tokens", "24"]) == 0
    plain = capsys.readouterr().out
    assert main([*base, "--max-tokens", "24", "--repetition-penalty", "1.5"]) == 0
    assert capsys.readouterr().out != plain
