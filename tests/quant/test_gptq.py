"""GPTQ for int4 (quant/gptq.py): the layer's output error over calibration inputs, the stored
layout the other int4 encoders write, degenerate inputs, and the CLI path end to end."""

from __future__ import annotations

import json

import pytest
import torch

from deltaserve.cache.sequence import Sequence
from deltaserve.cli import main
from deltaserve.errors import ConfigError
from deltaserve.quant import gptq
from deltaserve.quant.calibrate import input_statistics
from deltaserve.quant.convert import quantizable_names, quantize_checkpoint
from deltaserve.quant.gptq import DAMP, gptq_quantize, inverse_factor
from deltaserve.quant.schemes import (
    INT4,
    affine_fit,
    dequantize,
    group_weights,
    quantize,
    unpack_codes,
)

TEXT = "def add(a, b):\n    return a + b\n\n" * 40


def correlated(rows: int, cols: int, tokens: int, seed: int, held_out: int = 0):
    """Weights, inputs whose columns are correlated (as a layer's are), and H = X^T X / T; with
    held_out, also that many more tokens of the same distribution (not in H)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(cols, cols, generator=g) / cols**0.5
    x = (torch.randn(tokens + held_out, cols, generator=g) @ mix
         + 0.3 * torch.randn(tokens + held_out, cols, generator=g))
    w = torch.randn(rows, cols, generator=g) / cols**0.5
    fit = x[:tokens]
    if held_out:
        return w, fit, fit.T @ fit / tokens, x[tokens:]
    return w, fit, fit.T @ fit / tokens


def output_error(w, x, packed) -> float:
    d = w - dequantize(packed, INT4)
    return ((x @ d.T).square().mean() / (x @ w.T).square().mean()).item()


@pytest.mark.parametrize("seed", [0, 1])
def test_gptq_lowers_the_output_error_the_search_leaves(seed) -> None:
    """On inputs it never saw (same distribution as its calibration): 0.71x the search's output
    error at seed 0, measured (with or without the search's importance weights)."""
    w, _, h, x = correlated(192, 320, 1536, seed, held_out=1536)
    gptq = output_error(w, x, gptq_quantize(w, INT4, h))
    search = output_error(w, x, quantize(w, INT4))
    weighted = output_error(w, x, quantize(w, INT4, importance=torch.diagonal(h)))
    assert gptq < 0.85 * min(search, weighted), (gptq, search, weighted)


def naive_codes(w: torch.Tensor, u: torch.Tensor, imp: torch.Tensor) -> torch.Tensor:
    """GPTQ as the paper writes it, fp64: every column's error applied to every later column at
    once, each group's pair fitted when the walk reaches it."""
    w, (rows, cols), size = w.clone(), w.shape, INT4.group_size
    codes = torch.empty(rows, cols, dtype=torch.float64)
    for g in range(cols // size):
        scale, bias = affine_fit(w[:, g * size : (g + 1) * size].reshape(rows, 1, size), 15,
                                 torch.float16, imp[:, g : g + 1])
        sf, bf = scale.double()[:, 0], bias.double()[:, 0]
        for j in range(g * size, (g + 1) * size):
            q = ((w[:, j] - bf) / sf).round().clamp(0, 15).nan_to_num(0.0)
            codes[:, j] = q
            w[:, j + 1 :] -= ((w[:, j] - (q * sf + bf)) / u[j, j])[:, None] * u[j, j + 1 :][None]
    return codes


def test_the_blocked_walk_gives_the_naive_codes() -> None:
    """The walk's in-group updates plus one product per group equal the column-by-column update:
    bit-identical codes in the first group (the same operations), and in fp64 later groups differ
    only where a sum taken in another order lands on the other side of a rounding tie (measured:
    10 of 6,144 codes, all in one row after its first flip)."""
    w, _, h = correlated(24, 256, 600, 7)
    w, u = w.double(), inverse_factor(h)
    imp = group_weights(torch.diagonal(h), 256, 64).double()
    codes, _, _ = gptq._walk(w.clone(), u, imp, INT4, torch.float16)
    naive = naive_codes(w, u, imp)
    assert torch.equal(codes[:, :64].double(), naive[:, :64])
    differ = codes.double() != naive
    assert differ.float().mean() <= 0.01 and differ.any(1).sum() <= 1, differ.nonzero()[:5]


def test_row_passes_do_not_change_the_result(monkeypatch) -> None:
    w, _, h = correlated(50, 128, 300, 8)
    whole = gptq_quantize(w, INT4, h)
    monkeypatch.setattr(gptq, "AFFINE_ROWS_PER_PASS", 7)
    parts = gptq_quantize(w, INT4, h)
    assert all(torch.equal(whole[k], parts[k]) for k in whole)


def test_gptq_writes_the_int4_layout() -> None:
    w, _, h = correlated(70, 128, 400, 3)
    ours, plain = gptq_quantize(w, INT4, h), quantize(w, INT4)
    assert {k: (v.shape, v.dtype) for k, v in ours.items()} == {
        k: (v.shape, v.dtype) for k, v in plain.items()}
    codes = unpack_codes(ours["weight"], 4)
    assert codes.min() >= 0 and codes.max() <= 15 and not torch.equal(codes, unpack_codes(
        plain["weight"], 4))
    # per weight the error stays of the search's order: GPTQ trades it for the output's
    per_weight = (dequantize(ours, INT4) - w).square().mean() / (
        dequantize(plain, INT4) - w).square().mean()
    assert 0.9 < per_weight < 3.0, per_weight


def test_inverse_factor_is_the_damped_inverse_cholesky() -> None:
    _, _, h = correlated(8, 96, 300, 4)
    u = inverse_factor(h).double()
    damped = h.double() + DAMP * torch.diagonal(h).double().mean() * torch.eye(96,
                                                                               dtype=torch.double)
    assert torch.allclose(u.T @ u, torch.linalg.inv(damped), rtol=1e-6, atol=1e-9)
    assert torch.equal(u, u.triu())


def test_dead_inputs_neither_inflate_the_damping_nor_couple() -> None:
    """Small activations (diag ~1e-4) with a quarter of the inputs dead: the live block is damped
    by DAMP times the live inputs' mean diagonal (not by the dead ones' unit stand-ins), and no
    dead input's row of U reaches another column."""
    _, x, _ = correlated(8, 128, 400, 9)
    x = 0.01 * x
    x[:, ::4] = 0.0
    h = (x.T @ x / x.shape[0]).double()
    live = torch.ones(128, dtype=torch.bool)
    live[::4] = False
    u = inverse_factor(h)
    block = h[live][:, live]
    damped = block + DAMP * torch.diagonal(block).mean() * torch.eye(96, dtype=torch.double)
    assert torch.allclose((u.T @ u)[live][:, live], torch.linalg.inv(damped), rtol=1e-6)
    dead_rows = u[~live]
    assert torch.equal(dead_rows.abs().sum(1), torch.diagonal(u)[~live].abs())


def test_dead_inputs_and_constant_groups_stay_finite() -> None:
    """Columns that never fire (zero rows and columns of H) and a constant group: finite codes and
    values; the constant group is stored exactly."""
    w, x, _ = correlated(40, 192, 500, 5)
    x[:, :64] = 0.0  # one whole group of dead inputs
    h = x.T @ x / x.shape[0]
    w[:, 64:128] = 0.25
    packed = gptq_quantize(w, INT4, h)
    back = dequantize(packed, INT4)
    assert torch.isfinite(back).all()
    assert torch.equal(back[:, 64:128], w[:, 64:128])


def test_bad_covariances_are_clear_errors() -> None:
    w, _, h = correlated(16, 128, 200, 6)
    with pytest.raises(ValueError, match="covariance has shape"):
        gptq_quantize(w, INT4, h[:64, :64])
    bad = h.clone()
    bad[3, 3] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        gptq_quantize(w, INT4, bad)
    with pytest.raises(ValueError, match="affine"):
        from deltaserve.quant.schemes import INT8

        gptq_quantize(w, INT8, h)


def test_statistics_give_each_linear_its_covariance(tiny_dir) -> None:
    """covariance=True: every Linear's entry is [K, K], symmetric, its diagonal the importance;
    the tied embedding keeps its [K] mean square."""
    from deltaserve.quant.calibrate import input_importance

    with pytest.warns(UserWarning, match="200 calibration tokens for inputs up to .* rank-deficient"):
        cov = input_statistics(tiny_dir, TEXT, max_tokens=200, covariance=True)
    imp = input_importance(tiny_dir, TEXT, max_tokens=200)
    assert set(cov) == set(imp) == quantizable_names(tiny_dir)
    for name, v in cov.items():
        if name == "model.embed_tokens":
            assert v.dim() == 1 and torch.allclose(v, imp[name])
            continue
        assert v.dim() == 2 and torch.allclose(v, v.T, atol=1e-6), name
        assert torch.allclose(torch.diagonal(v), imp[name], rtol=1e-4, atol=1e-7), name


def test_gptq_from_the_cli_writes_a_loadable_checkpoint(tiny_dir, tmp_path, capsys) -> None:
    calib = tmp_path / "calib.txt"
    calib.write_text(TEXT)
    assert main(["quantize", "--model", str(tiny_dir), "--format", "int4", "--encoder", "gptq",
                 "--calibration", str(calib), "--calibration-tokens", "200",
                 str(tmp_path / "q")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["encoder"] == "gptq"
    assert set(summary["gptq"]) == quantizable_names(tiny_dir) - {"model.embed_tokens"}
    from deltaserve import LLM

    llm = LLM(tmp_path / "q", dtype="float32")
    ids = torch.tensor([llm.tokenizer.encode("def f(x):")])
    assert torch.isfinite(Sequence(llm.model, ids.shape[1]).forward(ids)).all()


def test_an_unusable_covariance_is_a_clear_error_naming_the_module(tiny_dir, tmp_path) -> None:
    name = "model.layers.0.mlp.down_proj"
    width = dict(quantizable_sizes(tiny_dir))[name]
    bad = torch.eye(width)
    bad[1, 1] = float("inf")
    with pytest.raises(ConfigError, match=f"GPTQ cannot encode {name}: .*non-finite"):
        quantize_checkpoint(tiny_dir, "int4", tmp_path / "q", importance={name: bad})
    assert not (tmp_path / "q").exists()


def quantizable_sizes(model_dir) -> list[tuple[str, int]]:
    """(module name, input width) of the float checkpoint's quantizable modules."""
    from safetensors import safe_open

    from deltaserve.checkpoint.reader import TensorIndex, lm_name

    index, out = TensorIndex.scan(model_dir), []
    names = quantizable_names(model_dir)
    for key, (file, _) in index.locations.items():
        ours = lm_name(key)
        if ours and ours.removesuffix(".weight") in names and key.endswith(".weight"):
            with safe_open(str(file), framework="pt") as f:
                out.append((ours.removesuffix(".weight"), f.get_slice(key).get_shape()[1]))
    return out


def test_bad_gptq_requests_are_clear_errors(tiny_dir, tmp_path, capsys) -> None:
    assert main(["quantize", "--model", str(tiny_dir), "--format", "int4", "--encoder", "gptq",
                 str(tmp_path / "a")]) == 1
    assert "--calibration" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="gptq encoder needs --format int4"):
        quantize_checkpoint(tiny_dir, "int8", tmp_path / "b",
                            importance={"model.layers.0.mlp.down_proj": torch.eye(8)})
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_covariances_that_would_not_fit_are_refused_before_the_run(tiny_dir, monkeypatch) -> None:
    import deltaserve.cache.memory as memory

    monkeypatch.setattr(memory, "available_bytes", lambda device: 1 << 20)
    with pytest.raises(ConfigError, match=r"covariances need .* GiB of memory is available"):
        input_statistics(tiny_dir, TEXT, max_tokens=200, covariance=True)
