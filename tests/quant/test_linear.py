"""quant/linear.py: the quantized module's scales narrowed after loading (narrow_scales_)."""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.quant.linear import narrow_scales_, quantize_module_
from deltaserve.quant.schemes import INT4, INT8, quantize


def packed_linear(scheme, scales: torch.Tensor, biases: torch.Tensor | None = None) -> nn.Module:
    rows, groups = scales.shape
    module = nn.Linear(groups * scheme.group_size, rows, bias=False)
    quantize_module_(module, scheme)
    module.scales.data.copy_(scales)
    if biases is not None:
        module.biases.data.copy_(biases)
    return module


def test_fp16_values_narrow_to_fp16_exactly() -> None:
    """What our files store (fp16 scales and biases, widened at load): back to fp16, same values."""
    q = quantize(torch.randn(40, 256), INT4)
    module = packed_linear(INT4, q["scales"].float(), q["biases"].float())
    before = (module.scales.data.clone(), module.biases.data.clone())
    assert narrow_scales_(module) == 2
    assert module.scales.dtype == module.biases.dtype == torch.float16
    assert torch.equal(module.scales.float(), before[0])
    assert torch.equal(module.biases.float(), before[1])
    assert narrow_scales_(module) == 0  # nothing left to narrow


def test_each_module_takes_the_narrowest_dtype_exact_for_both() -> None:
    """bf16-only values (beyond fp16's range) make the module bf16, its fp16-exact biases too;
    values neither holds keep the module fp32; other modules narrow on their own."""
    wide = packed_linear(INT8, torch.full((4, 2), 2.0**20))
    fine = packed_linear(INT8, torch.full((4, 2), 1.0 + 2.0**-20))
    mixed = packed_linear(INT4, torch.full((4, 2), 0.5), torch.full((4, 2), 2.0**20))
    stuck = packed_linear(INT4, torch.full((4, 2), 0.5), torch.full((4, 2), 1.0 + 2.0**-20))
    model = nn.Sequential(wide, fine, mixed, stuck, nn.LayerNorm(8))
    assert narrow_scales_(model) == 3
    assert wide.scales.dtype == torch.bfloat16 and wide.scales.float().eq(2.0**20).all()
    assert fine.scales.dtype == torch.float32
    assert mixed.scales.dtype == mixed.biases.dtype == torch.bfloat16
    assert mixed.scales.float().eq(0.5).all() and mixed.biases.float().eq(2.0**20).all()
    assert stuck.scales.dtype == stuck.biases.dtype == torch.float32


def test_fp32_denormals_are_not_narrowed_to_zero_with_denormals_flushed() -> None:
    """The CPU loader flushes denormals before narrowing: an fp32 denormal scale then compares
    equal to the fp16 zero it rounds to, so exactness is decided on the bits, not on ==. bf16
    (fp32's exponent range) holds this one exactly, so the module goes there, bits intact."""
    before = torch.set_flush_denormal(True)
    try:
        scales = torch.full((4, 2), 0.5)
        scales[0, 0] = torch.tensor([0x00400000], dtype=torch.int32).view(torch.float32)[0]
        module = packed_linear(INT8, scales)
        bits = module.scales.data.view(torch.int32).clone()
        assert narrow_scales_(module) == 1
        assert module.scales.dtype == torch.bfloat16
        assert torch.equal(module.scales.data.float().view(torch.int32), bits)
    finally:
        torch.set_flush_denormal(before)


def test_a_pair_held_in_two_dtypes_is_decided_afresh() -> None:
    """fp16 scales beside fp32 biases (no loader makes them; a caller might): narrowed to one
    dtype together, as the CPU kernels need, values unchanged."""
    q = quantize(torch.randn(40, 256), INT4)
    module = packed_linear(INT4, q["scales"].float(), q["biases"].float())
    module.scales = nn.Parameter(q["scales"].half(), False)
    assert narrow_scales_(module) == 2
    assert module.scales.dtype == module.biases.dtype == torch.float16
    assert torch.equal(module.biases, q["biases"].half())
