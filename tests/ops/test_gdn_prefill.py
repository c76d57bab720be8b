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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("fla") is None,
                    reason="needs CUDA and fla-core")
@pytest.mark.parametrize("stops", [(), (64, 192)])
def test_layer_scan_with_conv_normalised_qk_matches_fla_norms(monkeypatch, stops) -> None:
    """The GDN layer's long bf16 prefill: the conv writing contiguous L2-normalised q and k
    (DELTASERVE_CONV_QKV, default) against fla's own l2norm on the split conv output (=0): the
    same stages after a norm reduced in another order, so outputs, final state and snapshots
    agree to bf16 rounding."""
    from deltaserve.checkpoint.presets import preset
    from deltaserve.config import TextConfig
    from deltaserve.env import env
    from deltaserve.layers.gated_deltanet import GatedDeltaNet
    from deltaserve.ops import fla_scan

    cfg = TextConfig.from_hf(preset("qwen3.5-0.8b").config)
    torch.manual_seed(0)
    layer = GatedDeltaNet(cfg, torch.bfloat16).cuda()
    for p in layer.parameters():
        p.data.normal_(0, 0.05)
    layer.A_log.data.uniform_(-1, 1)
    seq_len = 300
    qkv = torch.randn(1, seq_len, cfg.conv_dim + 64, device="cuda").bfloat16()[..., :cfg.conv_dim]
    z = torch.randn(1, seq_len, layer.value_dim, device="cuda").bfloat16()
    b = torch.randn(1, seq_len, layer.num_v_heads, device="cuda").bfloat16()
    a = torch.randn(1, seq_len, layer.num_v_heads, device="cuda").bfloat16()
    window = torch.randn(1, cfg.conv_dim, 3, device="cuda").bfloat16()
    state0 = torch.randn(1, layer.num_v_heads, layer.k_dim, layer.v_dim, device="cuda") * 0.1
    calls = []
    real = fla_scan.fla_prefill

    def spy(*args, **kw):
        calls.append(kw.get("qk_normed", False))
        return real(*args, **kw)

    monkeypatch.setattr(fla_scan, "fla_prefill", spy)
    runs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("DELTASERVE_CONV_QKV", flag)
        env.cache_clear()
        state, snaps = state0.clone(), {}
        o, new_window = layer._scan(qkv, z, b, a, window, state, torch.bfloat16, stops,
                                    lambda n, s, snaps=snaps: snaps.setdefault(n, s.clone()))
        runs[flag] = (o, new_window, state, snaps)
    env.cache_clear()
    assert calls == [True, False]
    (o1, w1, s1, snaps1), (o0, w0, s0, snaps0) = runs["1"], runs["0"]
    assert torch.equal(w1, w0)  # the new window is the chunk's last inputs either way
    assert rel(o1, o0) <= 1e-2 and rel(s1, s0) <= 1e-2
    assert set(snaps1) == set(snaps0) == set(stops)
    for n in stops:
        assert rel(snaps1[n], snaps0[n]) <= 1e-2
