"""Calibrated int4 encoding: per-column input importance from the float model, and the search
weighing each column's error by it."""

from __future__ import annotations

import pytest
import torch

from deltaserve.cache.sequence import Sequence
from deltaserve.cli import main
from deltaserve.errors import ConfigError
from deltaserve.quant.calibrate import MIN_TOKENS, input_importance, read_calibration
from deltaserve.quant.convert import quantizable_names, quantize_checkpoint
from deltaserve.quant.schemes import FORMATS, dequantize, quantize

TEXT = "def add(a, b):\n    return a + b\n\n" * 40


def test_importance_covers_every_quantized_module_with_its_input_mean_square(tiny_dir,
                                                                             tiny_llm) -> None:
    """One [K] entry per module the quantizer packs; the tied embedding's is the head's input
    (final-normed hidden), computed here independently."""
    imp = input_importance(tiny_dir, TEXT, max_tokens=200)
    assert set(imp) == quantizable_names(tiny_dir)
    cfg = tiny_llm.config
    for name, v in imp.items():
        width = cfg.intermediate_size if name.endswith("down_proj") else (
            cfg.num_attention_heads * cfg.head_dim if name.endswith("o_proj") else
            cfg.linear_num_value_heads * cfg.linear_value_head_dim if name.endswith("out_proj")
            else cfg.hidden_size)
        assert v.shape == (width,) and torch.isfinite(v).all() and (v > 0).any(), name
    ids = torch.tensor([tiny_llm.tokenizer.encode(TEXT)[:200]])
    with torch.inference_mode():
        h = Sequence(tiny_llm.model, ids.shape[1]).hidden(ids)
    want = h.reshape(-1, h.shape[-1]).float().square().mean(0)
    assert torch.allclose(imp["model.embed_tokens"], want, rtol=1e-4, atol=1e-7)


def test_importance_weighs_the_search_toward_important_columns() -> None:
    """The weighted error never exceeds min/max's; a column weighed 1000x the others keeps less
    error than without the weights."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(64, 256, generator=gen) * 0.05
    importance = torch.ones(256)
    importance[::64] = 1000.0  # the first column of each group
    scheme = FORMATS["int4"]
    weights = importance.reshape(4, 64)
    err = {}
    for name, kw in {"minmax": {"search": False}, "plain": {},
                     "weighted": {"importance": importance}}.items():
        d = dequantize(quantize(w, scheme, **kw), scheme)
        err[name] = (d - w).square().reshape(64, 4, 64)
    weighted = {k: (e * weights).sum(-1) for k, e in err.items()}
    assert (weighted["weighted"] <= weighted["minmax"]).all()
    assert err["weighted"][..., 0].sum() < 0.5 * err["plain"][..., 0].sum()
    with pytest.raises(ValueError, match="inputs"):
        quantize(w, scheme, importance=torch.ones(255))
    # only relative weights count: a scaled importance (by a power of two: exactly) gives the same
    # codes; an all-zero or NaN importance weighs every column alike, as no importance does
    scaled = quantize(w, scheme, importance=importance * 2.0**-70)
    assert torch.equal(scaled["weight"], quantize(w, scheme, importance=importance)["weight"])
    nan_at_3 = torch.zeros(256).index_fill_(0, torch.tensor([3]), float("nan"))
    flat = (dequantize(quantize(w, scheme, importance=nan_at_3), scheme) - w).square().sum()
    assert flat <= 1.01 * err["plain"].sum() and flat < 0.95 * err["minmax"].sum()


def test_calibrated_quantize_writes_a_loadable_checkpoint(tiny_dir, tmp_path, capsys) -> None:
    """Every quantized module calibrated, the codes unlike an uncalibrated run's, the model runs."""
    import json

    from safetensors.torch import load_file

    calib = tmp_path / "calib.txt"
    calib.write_text(TEXT)
    assert main(["quantize", "--model", str(tiny_dir), "--format", "int4", "--calibration",
                 str(calib), "--calibration-tokens", "200", str(tmp_path / "q")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert set(summary["calibrated"]) == quantizable_names(tiny_dir)
    quantize_checkpoint(tiny_dir, "int4", tmp_path / "plain")
    ours, plain = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("q", "plain"))
    assert not all(torch.equal(ours[k], plain[k]) for k in ours if k.endswith(".scales"))
    from deltaserve import LLM

    llm = LLM(tmp_path / "q", dtype="float32")
    ids = torch.tensor([llm.tokenizer.encode("def f(x):")])
    assert torch.isfinite(Sequence(llm.model, ids.shape[1]).forward(ids)).all()


def test_bad_calibration_requests_are_clear_errors(tiny_dir, tmp_path, capsys) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(ConfigError, match="empty"):
        read_calibration(empty)
    with pytest.raises(ConfigError, match="cannot read"):
        read_calibration(tmp_path / "missing.txt")
    with pytest.raises(ConfigError, match=f"at least {MIN_TOKENS}"):
        input_importance(tiny_dir, "def f(): pass")
    with pytest.raises(ConfigError, match="int4"):
        quantize_checkpoint(tiny_dir, "int8", tmp_path / "q8", importance={})
    calib = tmp_path / "calib.txt"
    calib.write_text(TEXT)
    assert main(["quantize", "--model", str(tiny_dir), "--format", "q1", "--calibration",
                 str(calib), str(tmp_path / "q1")]) == 1
    assert "--format int4" in capsys.readouterr().err
    assert not (tmp_path / "q1").exists()  # refused before anything was written
