"""The one-launch recurrent prefill scan (ops/triton_gdn_scan) against gdn_recurrent_ref: outputs,
final state and the states at snapshot stops; a chunk split at a stop and resumed from that
snapshot gives the same bits as the unsplit chunk (what an exact prefix-cache hit relies on)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops.gdn import gdn_recurrent_ref
from tests.ops.test_gdn_prefill import _inputs as inputs
from tests.ops.triton_device import KDEV, needs_kernels, rel

pytestmark = [pytest.mark.gpu, needs_kernels]


def _inputs(seq_len, dtype):
    return inputs(KDEV, dtype, seq_len=seq_len)


def _reference(q, k, v, g, beta, state):
    rep = v.shape[2] // q.shape[2]
    qe, ke = q.float().repeat_interleave(rep, 2), k.float().repeat_interleave(rep, 2)
    return gdn_recurrent_ref(qe, ke, v.float(), g, beta, state.clone(), qk_l2norm=True)


@pytest.mark.parametrize("seq_len", [1, 7, 40, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scan_matches_the_recurrence(seq_len, dtype) -> None:
    from deltaserve.ops.triton_gdn_scan import gdn_scan_cuda

    q, k, v, g, beta, state = _inputs(seq_len, dtype)
    before = state.clone()
    o, final = gdn_scan_cuda(q, k, v, g, beta, state)
    ref_o, ref_final = _reference(q, k, v, g, beta, state)
    assert torch.equal(state, before)  # read, not written
    assert o.dtype == torch.float32 and o.shape == ref_o.shape
    assert rel(o, ref_o) <= 1e-5 and rel(final, ref_final) <= 1e-5


def test_stops_report_the_states_the_scan_carries_on_from() -> None:
    from deltaserve.ops.triton_gdn_scan import gdn_scan_cuda

    q, k, v, g, beta, state = _inputs(50, torch.bfloat16)
    got = {}
    o, final = gdn_scan_cuda(q, k, v, g, beta, state, (10, 32, 50, 99),
                             lambda n, s: got.setdefault(n, s.clone()))
    assert sorted(got) == [10, 32, 50]  # a stop past the chunk is not reported
    assert torch.equal(got[50], final)
    for n in (10, 32):
        _, ref_state = _reference(*(t[:, :n] for t in (q, k, v, g, beta)), state)
        assert rel(got[n], ref_state) <= 1e-5
    # resume from the snapshot at 32: the rest of the chunk gives the unsplit chunk's bits
    tail = (t[:, 32:] for t in (q, k, v, g, beta))
    o_tail, final_tail = gdn_scan_cuda(*tail, got[32])
    assert torch.equal(o_tail, o[:, 32:]) and torch.equal(final_tail, final)


def test_strided_projection_views_are_read_in_place() -> None:
    """q, k, v as the model passes them: views of one [B,T,C] conv output, split by channel."""
    from deltaserve.ops.triton_gdn_scan import gdn_scan_cuda

    q, k, v, g, beta, state = _inputs(24, torch.bfloat16)
    packed = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1)
    qv, kv, vv = torch.split(packed, [q[0, 0].numel(), k[0, 0].numel(), v[0, 0].numel()], -1)
    views = (qv.view(q.shape), kv.view(k.shape), vv.view(v.shape))
    o, final = gdn_scan_cuda(*views, g, beta, state)
    o_ref, final_ref = gdn_scan_cuda(q.contiguous(), k.contiguous(), v.contiguous(), g, beta, state)
    assert torch.equal(o, o_ref) and torch.equal(final, final_ref)


def test_gated_form_equals_gates_then_scan_and_updates_state_in_place() -> None:
    """The layer's one-launch form: gates from raw a, b views (strided, as the input projection's
    split gives them) and the state written in place, against gdn_gates + the plain scan."""
    from deltaserve.ops.gdn import gdn_gates
    from deltaserve.ops.triton_gdn_scan import gdn_scan_cuda, gdn_scan_gated_cuda

    q, k, v, _, _, state = _inputs(33, torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    proj = (torch.randn(1, 33, 8 + 2, generator=gen) * 3).to(KDEV).bfloat16()  # [.., b | a | more]
    b, a = proj[..., :4], proj[..., 4:8]
    a_log = torch.randn(4, generator=gen).to(KDEV)
    dt_bias = torch.randn(4, generator=gen).to(KDEV)
    g, beta = gdn_gates(a, b, a_log, dt_bias)
    want_o, want_state = gdn_scan_cuda(q, k, v, g, beta, state, (16,))
    live = state.clone()
    got = {}
    o = gdn_scan_gated_cuda(q, k, v, a, b, a_log, dt_bias, live, (16,),
                            lambda n, s: got.setdefault(n, s.clone()))
    assert rel(o, want_o) <= 1e-6 and rel(live, want_state) <= 1e-6
    assert list(got) == [16]
    with pytest.raises(ValueError):
        gdn_scan_gated_cuda(q, k, v, a, b, a_log, dt_bias, state.transpose(-1, -2))
