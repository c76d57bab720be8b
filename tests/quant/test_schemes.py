"""Quantize -> dequantize error bounds per format; packing layouts checked bit by bit."""

from __future__ import annotations

import pytest
import torch

from deltaserve.errors import CheckpointError
from deltaserve.quant.schemes import FORMATS, Scheme, dequantize, pack_codes, quantize, unpack_codes


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize(
    ("fmt", "bound"), [("int8", 0.01), ("int4", 0.12), ("q1", 0.65)]
)
def test_round_trip_error_is_within_the_format_bound(fmt, bound) -> None:
    torch.manual_seed(1)
    w = torch.randn(67, 384) * 0.05
    scheme = FORMATS[fmt]
    err = rel(dequantize(quantize(w, scheme), scheme), w)
    assert 0 < err <= bound  # 1-bit on Gaussian weights: sqrt(1 - 2/pi) = 0.60


def test_int8_max_error_is_half_a_step_per_group() -> None:
    torch.manual_seed(2)
    w = torch.randn(9, 256)
    t = quantize(w, FORMATS["int8"])
    step = t["scales"].float().repeat_interleave(64, dim=1)
    assert ((dequantize(t, FORMATS["int8"]) - w).abs() <= step * 0.5 + 1e-6).all()


def test_affine_codes_pack_low_bits_first_into_uint32_words() -> None:
    codes = torch.arange(16).remainder(16).reshape(1, 16)
    words = pack_codes(codes, 4)
    assert words.dtype == torch.uint32 and words.shape == (1, 2)
    assert int(words[0, 0].item()) == 0x76543210 and int(words[0, 1].item()) == 0xFEDCBA98
    assert torch.equal(unpack_codes(words, 4), codes)


def test_q1_bits_are_lsb_first_and_signs_times_scale() -> None:
    w = torch.full((1, 128), -1.0)
    w[0, 0], w[0, 9] = 2.0, 3.0
    t = quantize(w, FORMATS["q1"])
    assert t["weight"][0, 0].item() == 1 and t["weight"][0, 1].item() == 2  # bits 0 and 9
    d = t["scales"][0, 0].float().item()
    assert d == pytest.approx((2 + 3 + 126) / 128, rel=1e-3)
    out = dequantize(t, FORMATS["q1"])
    assert out[0, 0].item() == pytest.approx(d) and out[0, 1].item() == pytest.approx(-d)


def test_bad_schemes_and_widths_are_clear_errors() -> None:
    with pytest.raises(CheckpointError, match="unsupported quantization"):
        Scheme("int8", 4, 64)
    with pytest.raises(CheckpointError, match="group size"):
        Scheme("affine", 4, 12)
    with pytest.raises(CheckpointError, match="not a multiple of the group size"):
        quantize(torch.randn(4, 100), FORMATS["int4"])


@pytest.mark.parametrize("dist", ["gauss", "student-t3", "outlier"])
def test_affine_search_never_loses_to_min_max_and_wins_on_average(dist) -> None:
    """Every group's squared error with the searched (scale, bias) is at most min/max's (the
    search starts there), and the total is clearly lower; constant groups stay exact."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(96, 512, generator=gen) * 0.05
    if dist == "student-t3":
        torch.manual_seed(5)  # (distributions sample from the global generator)
        w = torch.distributions.StudentT(3.0).sample((96, 512)) * 0.05
    elif dist == "outlier":
        w[:, ::64] *= 12.0  # one large weight per group
    w[0, :64] = 0.25  # a constant group
    scheme = FORMATS["int4"]
    errs = {}
    for search in (True, False):
        d = dequantize(quantize(w, scheme, search=search), scheme)
        errs[search] = (d - w).square().reshape(96, 8, 64).sum(-1)
    assert (errs[True] <= errs[False]).all()
    assert errs[True].sum() <= 0.9 * errs[False].sum()
    assert errs[True][0, 0] == 0 and errs[False][0, 0] == 0
