"""Shared fixtures: synthetic checkpoints written once per session into a temporary cache."""

from __future__ import annotations

import atexit
import copy
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# Keep the default model and the built tokenizer out of the user's cache; one folder per
# session, removed at exit (CI machines run many sessions).
if "DELTASERVE_CACHE_DIR" not in os.environ:
    _session_cache = tempfile.mkdtemp(prefix="deltaserve-test-cache-")
    os.environ["DELTASERVE_CACHE_DIR"] = _session_cache
    atexit.register(shutil.rmtree, _session_cache, ignore_errors=True)
os.environ.setdefault("HF_HUB_OFFLINE", "1")


# the CPU flags that decide the C kernels' paths (ops/native.isa_paths), in the run's header
_ISA_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_bf16",
    "asimd",
    "sve",
)


def _isa_lines() -> list[str]:
    from deltaserve.env import env
    from deltaserve.ops.native import cpu_flags, isa_paths

    flags = cpu_flags()
    built = ", ".join(isa_paths()) or "none (torch's ops only)"
    return [
        f"cpu flags: {' '.join(f for f in _ISA_FLAGS if f in flags) or 'none of interest'}",
        f"CPU kernels (-march={env().cpu_march}): {built}; AVX2 and scalar builds too in "
        "tests/ops/test_native_isa.py, an x86-64-v3 one in tests/ops/test_isa_paths.py",
    ]


def pytest_report_header(config) -> list[str]:
    return _isa_lines()


def pytest_terminal_summary(terminalreporter) -> None:
    """Repeat the kernels' paths after the results, with how many tests skipped for lack of one."""
    from tests.isa import SKIP_PREFIX

    skips = [
        r
        for r in terminalreporter.stats.get("skipped", [])
        if isinstance(r.longrepr, tuple) and SKIP_PREFIX in str(r.longrepr[2])
    ]
    terminalreporter.write_sep("-", "ISA paths")
    for line in [*_isa_lines(), f"tests skipped for an ISA path the kernels lack: {len(skips)}"]:
        terminalreporter.write_line(line)


@pytest.fixture(autouse=True)
def _fresh_env():
    """env() is cached: every test starts from, and leaves behind, the real environment."""
    from deltaserve.env import env

    env.cache_clear()
    yield
    env.cache_clear()


def write_variant(out: Path, seed: int = 0, **text_overrides) -> Path:
    """The tiny preset with config overrides (e.g. value heads == key heads, untied head)."""
    from deltaserve.checkpoint.presets import Preset, preset
    from deltaserve.checkpoint.writer import write_checkpoint

    base = preset("tiny")
    cfg = copy.deepcopy(base.config)
    cfg.update(text_overrides)
    write_checkpoint(
        Preset("tiny-variant", cfg, 0, generation_config=base.generation_config), out, seed
    )
    return out


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """Flat qwen3_5_text checkpoint, V heads (4) != K heads (2), tied head, mtp.* tensors present."""
    return write_variant(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_llm(tiny_dir):
    from deltaserve import LLM

    return LLM(tiny_dir, dtype="float32")


@pytest.fixture(scope="session")
def tiny_reference(tiny_dir):
    from deltaserve.validate.reference import load_reference

    return load_reference(tiny_dir)


@pytest.fixture(scope="session")
def default_dir() -> Path:
    """The shipped default model, stdlib-19m."""
    from deltaserve.checkpoint.default import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="session")
def default_llm(default_dir):
    from deltaserve import LLM

    return LLM(default_dir, dtype="float32")


def read_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())
