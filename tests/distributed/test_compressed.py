"""The compressed all-reduce (16-bit transport of the FFN reductions) in 2 gloo processes: a
planted fp16 overflow is counted (unscaled) or avoided (dynamic scale), a planted NaN is counted
and stays where exact reduction puts it, other classes stay exact, and the gate of compressed
against exact reductions on the tiny model passes with its counters at zero."""

from __future__ import annotations

import pytest
import torch

from deltaserve.distributed.comm import Compression
from deltaserve.distributed.launch import spawn
from deltaserve.errors import ConfigError
from tests.distributed.tp_cases import compress_worker


@pytest.fixture(scope="module")
def result(tiny_dir, tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("compressed") / "out.pt"
    spawn(compress_worker, 2, str(tiny_dir), str(path))
    return torch.load(path, weights_only=False)


def test_planted_overflow_is_counted_without_scaling(result) -> None:
    raw = result["none"]
    assert raw["report"]["ffn"]["overflow"] == 1  # the one planted 110,677 (> 65,504)
    assert torch.isinf(raw["ffn"][3]) and torch.isfinite(raw["exact"][3])


def test_dynamic_scale_carries_the_same_tensor(result) -> None:
    dyn = result["dynamic"]
    assert dyn["report"]["ffn"]["overflow"] == 0
    err = (dyn["ffn"] - dyn["exact"]).abs().max() / dyn["exact"].abs().max()
    assert 0 < err <= 1e-3  # 16-bit transport, scaled: close, not exact


def test_planted_nan_is_counted_and_stays_in_place(result) -> None:
    for scaling in ("none", "dynamic"):
        out = result[scaling]
        assert out["report"]["ffn"]["nonfinite"] == 1  # one NaN on rank 1
        assert torch.isnan(out["nan"]).nonzero().flatten().tolist() == [5]


def test_classes_not_compressed_stay_exact(result) -> None:
    for scaling in ("none", "dynamic"):
        out = result[scaling]
        assert not out["report"]["attn"]["compressed"]
        assert torch.equal(out["attn"], out["exact"])


def test_gate_of_compressed_ffn_reductions_against_exact(result) -> None:
    gate = result["gate"]
    assert gate["passed"], gate["failures"]
    counters = gate["counters"]
    assert counters["ffn"]["compressed"] and counters["ffn"]["calls"] > 0
    assert counters["ffn"]["overflow"] == counters["ffn"]["nonfinite"] == 0
    assert not counters["attn"]["compressed"] and not counters["gdn"]["compressed"]
    assert 0 < gate["summary"]["js_max"] < 1e-4  # compressed really ran, and stayed close


def test_bad_compression_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match="transport"):
        Compression("fp8")
    with pytest.raises(ConfigError, match="classes"):
        Compression("fp16", ("mlp",))
