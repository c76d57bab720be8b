"""The prefill scan dispatcher: the torch path (CPU, fp32) equals gdn_chunked and reports every
wanted stop; fla-core's kernel (H200, bf16) against the fp32 scan on the same inputs."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from deltaserve.ops.gdn import gdn_chunked, gdn_prefill
from tests.ops.triton_device import rel


def _inputs(device, dtype, seq_len=200, heads_k=2, heads_v=4, dim=64):
    torch.manual_seed(seq_len)
    q = torch.randn(1, seq_len, heads_k, dim, device=device).to(dtype)
    k = torch.randn(1, seq_len, heads_k, dim, device=device).to(dtype)
    v = torch.randn(1, seq_len, heads_v, dim, device=device).to(dtype)
    g = -torch.rand(1, seq_len, heads_v, device=device) * 0.5
    beta = torch.rand(1, seq_len, heads_v, device=device)
    state = torch.randn(1, heads_v, dim, dim, device=device) * 0.1
    return q, k, v, g, beta, state


def _reference(q, k, v, g, beta, state, chunk_len=64):
    """The fp32 chunked scan; `seen` holds its state after every chunk_len tokens."""
    rep = v.shape[2] // q.shape[2]
    seen = {}
    o, final = gdn_chunked(q.float().repeat_interleave(rep, 2), k.float().repeat_interleave(rep, 2),
                           v.float(), g, beta, state.clone(), chunk_len=chunk_len, qk_l2norm=True,
                           on_boundary=lambda n, s: seen.setdefault(n, s.clone()))
    return o, final, seen


def test_torch_path_equals_the_chunked_scan_and_reports_stops() -> None:
    q, k, v, g, beta, state = _inputs("cpu", torch.float32)
    got = {}
    o, final = gdn_prefill(q, k, v, g, beta, state, (64, 192),
                           lambda n, s: got.setdefault(n, s.clone()))
    ref_o, ref_final, seen = _reference(q, k, v, g, beta, state)
    assert torch.equal(o, ref_o) and torch.equal(final, ref_final)
    assert {64, 192} <= set(got) and torch.equal(got[192], seen[192])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("fla") is None,
                    reason="needs CUDA and fla-core")
@pytest.mark.parametrize("stops", [(), (64, 128)])
def test_fla_path_matches_the_fp32_scan(stops) -> None:
    from deltaserve.ops.gdn import fla_usable

    q, k, v, g, beta, state = _inputs("cuda", torch.bfloat16)
    assert fla_usable(q)
    got = {}
    o, final = gdn_prefill(q, k, v, g, beta, state.clone(), stops,
                           lambda n, s: got.setdefault(n, s.clone()))
    ref_o, ref_final, seen = _reference(q, k, v, g, beta, state)

    assert rel(o, ref_o) <= 2e-2 and rel(final, ref_final) <= 2e-2
    assert set(got) == set(stops)
    for n in stops:
        assert rel(got[n], seen[n]) <= 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("fla") is None,
                    reason="needs CUDA and fla-core")
@pytest.mark.parametrize("stops", [(), (64, 128, 200), (40, 104, 168), (32, 64, 96, 160)])  # all /8
def test_fla_stage_driver_matches_one_public_call_per_segment(stops) -> None:
    """ops/fla_scan (one pass per stage; with stops, an fp32 state pass whose stored chunk states
    are the snapshots) against the fp32 scan, at least as close as fla's public call per segment
    (the path it replaced); stops off fla's 64-token grid start a new call."""
    from deltaserve.ops.fla_scan import fla_prefill, stages_available
    from deltaserve.ops.gdn import fla_public_prefill

    assert stages_available()
    q, k, v, g, beta, state = _inputs("cuda", torch.bfloat16)
    got, old = {}, {}
    o, final = fla_prefill(q, k, v, g, beta, state.clone(), stops,
                           lambda n, s: got.setdefault(n, s.clone()))
    old_o, old_final = fla_public_prefill(q, k, v, g, beta, state.clone(), stops,
                                          lambda n, s: old.setdefault(n, s.clone()))
    ref_o, ref_final, seen = _reference(q, k, v, g, beta, state, chunk_len=8)

    assert set(got) == set(old) == set(stops)
    pairs = [(o, old_o, ref_o), (final, old_final, ref_final)]
    pairs += [(got[n], old[n], seen[n]) for n in stops]
    for new, before, ref in pairs:
        assert rel(new, ref) <= 1.5 * rel(before, ref) + 1e-3 and rel(new, ref) <= 2e-2
