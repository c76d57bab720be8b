"""Bad input gives one clear error line naming the problem, never a traceback (through the CLI)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from deltaserve.cli import main


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _run(capsys, *argv: str) -> str:
    rc = main(["generate", "--max-tokens", "2", "--temperature", "0", *argv])
    err = capsys.readouterr().err
    assert rc == 1
    lines = [line for line in err.strip().splitlines() if line.startswith("deltaserve: error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def test_missing_folder(capsys, tmp_path) -> None:
    assert "does not exist" in _run(capsys, "--model", str(tmp_path / "nope"), "-p", "hi")


def test_missing_config(capsys, tiny_dir, tmp_path) -> None:
    d = _copy(tiny_dir, tmp_path / "c")
    (d / "config.json").unlink()
    assert "config.json not found" in _run(capsys, "--model", str(d), "-p", "hi")


def test_missing_weights_file(capsys, tiny_dir, tmp_path) -> None:
    d = _copy(tiny_dir, tmp_path / "c")
    (d / "model.safetensors").unlink()
    assert "no .safetensors weights" in _run(capsys, "--model", str(d), "-p", "hi")


def test_shard_listed_in_index_missing(capsys, tiny_dir, tmp_path) -> None:
    d = _copy(tiny_dir, tmp_path / "c")
    index = {
        "metadata": {},
        "weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"},
    }
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "model-00002-of-00002.safetensors" in _run(capsys, "--model", str(d), "-p", "hi")


def test_truncated_safetensors(capsys, tiny_dir, tmp_path) -> None:
    d = _copy(tiny_dir, tmp_path / "c")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    line = _run(capsys, "--model", str(d), "-p", "hi")
    assert "corrupt or truncated" in line and "model.safetensors" in line


def test_missing_tensor(capsys, tiny_dir, tmp_path) -> None:
    d = _copy(tiny_dir, tmp_path / "c")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.2.linear_attn.in_proj_z.weight"]
    save_file(tensors, d / "model.safetensors")
    assert "model.layers.2.linear_attn.in_proj_z.weight" in _run(
        capsys, "--model", str(d), "-p", "hi"
    )


def test_wrong_shape(capsys, tiny_dir, tmp_path) -> None:
    d = _copy(tiny_dir, tmp_path / "c")
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.3.self_attn.k_proj.weight"] = tensors[
        "model.layers.3.self_attn.k_proj.weight"
    ][:-1]
    save_file(tensors, d / "model.safetensors")
    line = _run(capsys, "--model", str(d), "-p", "hi")
    assert "model.layers.3.self_attn.k_proj.weight" in line and "shape" in line


def test_unknown_model_type(capsys, tiny_dir, tmp_path) -> None:
    d = _copy(tiny_dir, tmp_path / "c")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, model_type="llama")))
    assert "unknown model_type 'llama'" in _run(capsys, "--model", str(d), "-p", "hi")


def test_config_not_json(capsys, tiny_dir, tmp_path) -> None:
    d = _copy(tiny_dir, tmp_path / "c")
    (d / "config.json").write_text("{not json")
    assert "not valid JSON" in _run(capsys, "--model", str(d), "-p", "hi")


def test_prompt_longer_than_context(capsys, tiny_dir) -> None:
    line = _run(capsys, "--model", str(tiny_dir), "--max-model-len", "8", "-p", "word " * 20)
    assert "context limit is 8" in line


def test_bad_sampling_parameter(capsys, tiny_dir) -> None:
    line = _run(capsys, "--model", str(tiny_dir), "--top-p", "1.5", "-p", "hi")
    assert "top_p" in line


def test_hub_id_offline_is_a_clear_error(capsys, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    line = _run(capsys, "--model", "nobody-xyz/not-a-model-123", "-p", "hi")
    assert "could not be downloaded" in line or "not found" in line


@pytest.mark.parametrize("argv", [["--model", "/nonexistent/dir", "-p", "x"]])
def test_real_entry_point_prints_no_traceback(argv) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "deltaserve", "generate", *argv], capture_output=True, text=True
    )
    assert proc.returncode == 1
    assert (
        proc.stderr.strip() == "deltaserve: error: model folder '/nonexistent/dir' does not exist"
    )
    assert proc.stdout == ""
