"""No long operation in the README is silent: each runs here as the user runs it (a subprocess on
the tiny preset, stderr a pipe as in a log or CI), its stderr read as it arrives, and its progress
bar must appear and no silence between two outputs may pass 5 s."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.server.helpers import running_server

SILENCE_S = 5.0  # the bound between two outputs of a running operation
# before the first output: the interpreter and torch import, not the operation (1.2-3.6 s here)
STARTUP_S = 10.0


@dataclass
class Timeline:
    returncode: int
    stderr: str
    first_s: float  # seconds to the first stderr output
    longest_silence_s: float  # after it, to the process's exit


def timeline(*args: str, cwd: Path, env: dict[str, str] | None = None) -> Timeline:
    """Run `deltaserve ARGS`, timing each chunk of its stderr as it arrives."""
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "deltaserve", *args], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, **(env or {})})
    drain = threading.Thread(target=proc.stdout.read, daemon=True)  # a full pipe would block it
    drain.start()
    stamps, chunks = [], []
    while chunk := proc.stderr.read1(65536):
        stamps.append(time.monotonic() - start)
        chunks.append(chunk)
    proc.wait(timeout=600)
    end = time.monotonic() - start
    after = [b - a for a, b in zip(stamps, [*stamps[1:], end][:len(stamps)], strict=True)]
    return Timeline(proc.returncode, b"".join(chunks).decode(errors="replace"),
                    stamps[0] if stamps else end, max(after, default=end))


def assert_shown(t: Timeline, desc: str, counted: bool = True) -> None:
    """counted: the bar knows its total and must reach it; bench's counts steps as they come."""
    assert t.returncode == 0, t.stderr[-2000:]
    assert f"deltaserve: {desc}" in t.stderr, t.stderr[-2000:]
    assert "100%" in t.stderr if counted else f"{desc}: 0step" in t.stderr, t.stderr[-2000:]
    assert t.first_s <= STARTUP_S, (t.first_s, t.stderr[-500:])
    assert t.longest_silence_s <= SILENCE_S, (t.longest_silence_s, t.stderr[-2000:])


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A folder holding the tiny preset, written by `make-checkpoint` (checked as it runs)."""
    root = tmp_path_factory.mktemp("progress")
    assert_shown(timeline("make-checkpoint", "--preset", "tiny", "tiny", cwd=root), "writing tiny")
    return root


def test_quantize_int4_search_and_gptq_show_their_bars(work) -> None:
    calibration = work / "calib.txt"
    calibration.write_text("".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(40)))
    assert_shown(timeline("quantize", "-m", "tiny", "--format", "int4", "q4", cwd=work),
                 "quantizing to int4")
    gptq = timeline("quantize", "-m", "tiny", "--format", "int4", "--encoder", "gptq",
                    "--calibration", "calib.txt", "q4g", cwd=work)
    assert_shown(gptq, "quantizing to int4")
    assert "deltaserve: calibrating" in gptq.stderr


def test_gguf_write_and_import_show_their_bars(work) -> None:
    assert_shown(timeline("make-checkpoint", "--preset", "tiny", "--format", "gguf-q1_0",
                          "t.gguf", cwd=work), "writing t.gguf")
    assert_shown(timeline("import-gguf", "t.gguf", "tg", cwd=work), "importing GGUF")


def test_validate_bench_needle_and_gate_show_their_bars(work) -> None:
    assert_shown(timeline("validate", "--model", "tiny", "--num-tokens", "8", cwd=work), "validate")
    assert_shown(timeline("bench", "-m", "tiny", "--prefill-lens", "64", "--decode-tokens", "8",
                          "--repeats", "1", cwd=work), "bench transformers", counted=False)
    assert_shown(timeline("needle", "--lengths", "512", "--depths", "0.5", "--keys", "2",
                          cwd=work), "needle")
    prompts = json.loads((Path(__file__).parents[1] / "deltaserve/bench/gate_prompts.json")
                         .read_text())
    prompts["prompts"] = prompts["prompts"][:2]
    (work / "prompts.json").write_text(json.dumps(prompts))
    assert_shown(timeline("gate", "--model", "tiny", "--against", "tiny", "--prompts",
                          "prompts.json", cwd=work), "gate")


def test_bench_serve_shows_its_bar(work) -> None:
    with running_server("--max-model-len", "512") as (base, _):
        t = timeline("bench", "serve", "--base-url", base, "--num-prompts", "8",
                     "--random-input-len", "32", "--random-output-len", "8", cwd=work)
    assert_shown(t, "bench serve")


def test_hidden_with_deltaserve_progress_0(work) -> None:
    t = timeline("make-checkpoint", "--preset", "tiny", "hidden", cwd=work,
                 env={"DELTASERVE_PROGRESS": "0"})
    assert t.returncode == 0, t.stderr
    assert "writing" not in t.stderr


def test_loading_a_model_shows_a_bar_only_when_it_is_slow(work, monkeypatch, capsys) -> None:
    """The loader's bar waits LOAD_BAR_DELAY_S: the tiny preset loads without one, and with
    the wait at 0 its bar counts every tensor."""
    t = timeline("generate", "-m", "tiny", "--prompt", "a", "--max-tokens", "2", cwd=work)
    assert t.returncode == 0, t.stderr
    assert "loading weights" not in t.stderr
    from deltaserve.checkpoint import loader

    monkeypatch.setattr(loader, "LOAD_BAR_DELAY_S", 0.0)
    loader.load_text_model(work / "tiny")
    err = capsys.readouterr().err
    assert "deltaserve: loading weights" in err and "100%" in err, err
