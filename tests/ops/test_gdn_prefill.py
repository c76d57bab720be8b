"""The GDN prefill op (ops/gdn_prefill): the reference (CPU, fp32) composes the torch ops and reports
every wanted stop; fla-core's stages (H200, bf16) against the fp32 reference on the same inputs."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from deltaserve.ops.gdn import gdn_chunked
from deltaserve.ops.gdn_prefill import gdn_prefill
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


def _mixer_inputs(device, dtype, seq_len=200, heads_k=2, heads_v=4, dim=64):
    """The GDN prefill op's inputs: in-projection rows qkv, a, b, conv weight and window, gate
    parameters and an fp32 state."""
    gen = torch.Generator().manual_seed(seq_len)
    r = lambda *shape, s=1.0: (torch.randn(*shape, generator=gen) * s)  # noqa: E731
    channels = 2 * heads_k * dim + heads_v * dim
    inp = dict(qkv=r(1, seq_len, channels).to(dtype), a=r(1, seq_len, heads_v).to(dtype),
               b=r(1, seq_len, heads_v).to(dtype), conv_w=r(channels, 4, s=0.3),
               window=r(1, channels, 3).to(dtype),
               a_log=(torch.rand(heads_v, generator=gen) * 16 + 0.01).log(),
               dt_bias=1 + r(heads_v, s=0.1), state=r(1, heads_v, dim, dim, s=0.1))
    return {k: v.to(device) for k, v in inp.items()}, heads_k


def _run(fn, inp, heads_k, stops):
    """fn (an implementation of GDN_PREFILL) on copies of inp: (o, window, final state, states
    seen at the stops)."""
    state, seen = inp["state"].clone(), {}
    o, window = fn(inp["qkv"], inp["a"], inp["b"], inp["conv_w"], inp["window"], inp["a_log"],
                   inp["dt_bias"], state, heads_k, stops,
                   lambda n, s: seen.setdefault(n, s.clone()))
    return o, window, state, seen


def test_cpu_takes_the_reference_which_composes_the_torch_ops_and_reports_stops() -> None:
    """The op on CPU fp32 is the torch conv, gates and chunked scan (the state updated in place);
    every wanted stop's state is reported."""
    from deltaserve.ops.conv1d import causal_conv1d_ref
    from deltaserve.ops.gdn import gdn_gates
    from deltaserve.ops.gdn_prefill import GDN_PREFILL, prefill_case

    inp, heads_k = _mixer_inputs("cpu", torch.float32)
    assert GDN_PREFILL.choose(prefill_case(inp["qkv"], inp["state"], heads_k, 4)).name == \
        "reference"
    o, window, state, got = _run(gdn_prefill, inp, heads_k, (64, 192))
    conv = causal_conv1d_ref(inp["qkv"], inp["conv_w"], inp["window"])
    q, k, v = torch.split(conv, [128, 128, 256], dim=-1)
    g, beta = gdn_gates(inp["a"], inp["b"], inp["a_log"], inp["dt_bias"])
    shape = (1, 200, -1, 64)
    q, k, v = q.reshape(shape), k.reshape(shape), v.reshape(shape)
    ref_o, ref_final, seen = _reference(q, k, v, g, beta, inp["state"])
    assert rel(o, ref_o) <= 1e-6 and rel(state, ref_final) <= 1e-6
    assert torch.equal(window, inp["qkv"][:, -3:].transpose(1, 2))
    assert {64, 192} <= set(got) and rel(got[192], seen[192]) <= 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("fla") is None,
                    reason="needs CUDA and fla-core")
@pytest.mark.parametrize("stops", [(), (64, 128)])
def test_fla_path_matches_the_fp32_scan(stops) -> None:
    """A 200-token bf16 chunk takes fla's stages; against the reference on fp32 copies."""
    from deltaserve.ops.gdn_prefill import GDN_PREFILL, prefill_case

    inp, heads_k = _mixer_inputs("cuda", torch.bfloat16)
    chosen = GDN_PREFILL.choose(prefill_case(inp["qkv"], inp["state"], heads_k, 4))
    assert chosen.name.startswith("fla_stages")
    o, window, state, got = _run(gdn_prefill, inp, heads_k, stops)
    wide = {k: v.float() for k, v in inp.items()}
    ref_o, ref_window, ref_state, seen = _run(GDN_PREFILL.named("reference").fn, wide, heads_k,
                                              stops)
    assert rel(o, ref_o) <= 2e-2 and rel(state, ref_state) <= 2e-2
    assert torch.equal(window.float(), ref_window)
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
