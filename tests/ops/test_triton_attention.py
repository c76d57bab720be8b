"""Triton attention prologue and paged decode attention against the torch references (run on the
H200; the references themselves are checked on CPU in test_attention_refs.py)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.layers.rotary import Rotary
from deltaserve.ops import triton_attention as ta
from deltaserve.ops.attention import paged_decode_attention_ref, qk_prep_ref
from tests.ops.triton_device import KDEV, needs_kernels, rel

pytestmark = pytest.mark.gpu

HQ, HKV, D, L, NB = 8, 2, 256, 64, 12


def _pools(dtype):
    k = torch.randn(NB, HKV, L, D, device=KDEV).to(dtype)
    return k, torch.randn_like(k)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_prep_matches_reference(dtype) -> None:
    torch.manual_seed(0)
    num_tokens = 5
    proj = torch.randn(num_tokens, 2 * HQ * D + 2 * HKV * D, device=KDEV).to(dtype)
    q_w, k_w = torch.randn(D, device=KDEV) * 0.1, torch.randn(D, device=KDEV) * 0.1
    positions = torch.tensor([3, 64, 65, 200, 7], device=KDEV)
    cos, sin = Rotary(64, 1e7, torch.device(KDEV)).cos_sin(positions, dtype)
    blocks, rows = torch.tensor([0, 3, 3, 5, 1], device=KDEV), positions % L
    k0, v0 = _pools(dtype)
    k_ref, v_ref, k_got, v_got = k0.clone(), v0.clone(), k0.clone(), v0.clone()
    q_ref = qk_prep_ref(proj, q_w, k_w, cos, sin, k_ref, v_ref, blocks, rows, HQ, 1e-6)
    q_got = ta.qk_prep_cuda(proj, q_w, k_w, cos, sin, k_got, v_got, blocks, rows, HQ, 1e-6)
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    assert q_got.shape == q_ref.shape == (num_tokens, HQ, D) and rel(q_got, q_ref) <= tol
    assert rel(k_got, k_ref) <= tol and torch.equal(v_got, v_ref)
    written = torch.zeros(NB, dtype=torch.bool)
    written[blocks.cpu()] = True
    assert torch.equal(k_got[~written.to(KDEV)], k0[~written.to(KDEV)])  # other blocks untouched


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [[1, 64, 65, 300], [700]])
def test_paged_decode_attention_matches_reference(dtype, lengths) -> None:
    if KDEV == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter computes bf16 tl.dot wrongly; checked on CUDA")
    torch.manual_seed(len(lengths))
    bsz = len(lengths)
    k_pool, v_pool = _pools(dtype)
    width = max(-(-n // L) for n in lengths)
    tables = torch.stack([torch.randperm(NB, device=KDEV)[:width] for _ in range(bsz)])
    lens = torch.tensor(lengths, device=KDEV)
    q = torch.randn(bsz, HQ, D, device=KDEV).to(dtype)
    proj = torch.randn(bsz, 2 * HQ * D + 2 * HKV * D, device=KDEV).to(dtype)
    out = torch.full((bsz, HQ * D), float("nan"), device=KDEV, dtype=dtype)
    ta.paged_decode_attention_cuda(q, proj, k_pool, v_pool, tables, lens, D**-0.5, out)
    ref = paged_decode_attention_ref(q, proj, k_pool, v_pool, tables, lens, D**-0.5)
    assert rel(out, ref) <= (2e-6 if dtype == torch.float32 else 1e-2)


@needs_kernels
def test_paged_decode_attention_on_some_rows_of_a_step() -> None:
    """A mixed step: decode rows are tokens 1 and 4 of 6; the others of `out` stay untouched."""
    torch.manual_seed(5)
    k_pool, v_pool = _pools(torch.float32)
    tables = torch.tensor([[4, 2], [7, 0]], device=KDEV)
    lens = torch.tensor([70, 9], device=KDEV)
    q = torch.randn(6, HQ, D, device=KDEV)
    proj = torch.randn(6, 2 * HQ * D + 2 * HKV * D, device=KDEV)
    out = torch.zeros(6, HQ * D, device=KDEV)
    rows = torch.tensor([1, 4], device=KDEV)
    ta.paged_decode_attention_cuda(q, proj, k_pool, v_pool, tables, lens, D**-0.5, out, rows)
    ref = paged_decode_attention_ref(q[rows], proj[rows], k_pool, v_pool, tables, lens, D**-0.5)
    assert rel(out[rows], ref) <= 2e-6
    assert not out[[0, 2, 3, 5]].any()
