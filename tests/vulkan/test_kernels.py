"""Every Vulkan kernel against its torch reference on fresh random inputs, on whatever adapter
wgpu finds (CI: Mesa's lavapipe); skipped with the reason where there is none."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deltaserve.ops.gdn_decode import gdn_decode_slots_ref
from deltaserve.ops.norm import rms_norm_ref
from deltaserve.vulkan import device as vkdev
from deltaserve.vulkan import kernels, mixers

pytestmark = pytest.mark.skipif(not vkdev.available(), reason=vkdev.adapter_or_reason()[1])


@pytest.fixture(scope="module")
def dev():
    return vkdev.VulkanDevice()


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def run(dev, fn):
    rec = dev.recorder()
    fn(rec)
    rec.submit()


def test_rms_norm_and_the_residual_add(dev) -> None:
    x, w, res = torch.randn(5, 384), torch.randn(384) * 0.1, torch.randn(5, 384)
    xt, wt, rt, yt = dev.upload(x), dev.upload(w), dev.upload(res), dev.empty((5, 384))
    run(dev, lambda rec: kernels.rms_norm(rec, xt, wt, yt, 5, 384, 1e-6, 1.0))
    assert rel(dev.download(yt), rms_norm_ref(x, w, 1e-6, 1.0)) < 1e-6
    run(dev, lambda rec: kernels.rms_norm(rec, xt, wt, yt, 5, 384, 1e-6, 1.0, residual=rt))
    assert torch.equal(dev.download(rt), res + x)
    assert rel(dev.download(yt), rms_norm_ref(res + x, w, 1e-6, 1.0)) < 1e-6


def test_embedding_rows_from_every_part(dev, monkeypatch) -> None:
    table = torch.randn(1000, 48)
    monkeypatch.setattr(dev, "max_binding", 300 * 48 * 4)
    tt = dev.upload(table)
    ids = torch.tensor([0, 999, 299, 300, 650], dtype=torch.int32)
    it, yt = dev.upload(ids), dev.empty((5, 48))
    run(dev, lambda rec: kernels.embed(rec, tt, it, yt, 5))
    assert torch.equal(dev.download(yt), table[ids.long()])


def test_silu_mul(dev) -> None:
    gu = torch.randn(4, 2 * 300)
    gt, yt = dev.upload(gu), dev.empty((4, 300))
    run(dev, lambda rec: kernels.silu_mul(rec, gt, yt, 4, 300))
    assert rel(dev.download(yt), F.silu(gu[:, :300]) * gu[:, 300:]) < 1e-6


SHAPE = mixers.MixerShape(hk=2, hv=6, k=32, v=64, width=4, hq=4, hkv=2, d=64, rot=16,
                          block_len=8)


def test_gdn_conv_and_delta_rule_walk_each_sequence_in_order(dev) -> None:
    """Two sequences in one step, one a 5-row chunk and one a decode row (Hv = 3 Hk as in the
    27B), against the decode reference applied token by token."""
    s, slots, spans = SHAPE, [2, 0], [(0, 5), (5, 1)]
    gen = torch.Generator().manual_seed(0)
    proj = torch.randn(6, s.gdn_proj, generator=gen)
    conv_w = torch.randn(s.conv_dim, s.width, generator=gen) * 0.5
    a_log, dt_bias = torch.randn(s.hv, generator=gen) * 0.3, torch.randn(s.hv, generator=gen)
    norm_w = torch.randn(s.v, generator=gen) * 0.2 + 1
    window = torch.randn(3, s.conv_dim, s.width - 1, generator=gen)
    state = torch.randn(3, s.hv, s.k, s.v, generator=gen) * 0.1
    seqs = torch.tensor([[sl, r0, n, 0] for sl, (r0, n) in zip(slots, spans, strict=True)], dtype=torch.int32)
    t = {name: dev.upload(v) for name, v in
         dict(proj=proj, conv_w=conv_w, window=window, state=state, seqs=seqs,
              params=torch.cat([a_log, dt_bias, norm_w])).items()}
    conv, out = dev.empty((6, s.conv_dim)), dev.empty((6, s.hv * s.v))

    def step(rec):
        mixers.gdn_conv(rec, s, t["proj"], t["conv_w"], t["window"], conv, t["seqs"], 2, 5)
        mixers.gdn_delta(rec, s, t["proj"], conv, t["params"], t["state"], out, t["seqs"], 2,
                         1e-6, 5)
    run(dev, step)
    ref_window, ref_state, want = window.clone(), state.clone(), torch.empty(6, s.hv * s.v)
    c, z = s.conv_dim, s.hv * s.v
    for slot, (r0, n) in zip(slots, spans, strict=True):
        for r in range(r0, r0 + n):
            row = proj[r:r + 1]
            want[r] = gdn_decode_slots_ref(
                row[:, :c], row[:, c:c + z], row[:, c + z:c + z + s.hv], row[:, c + z + s.hv:],
                ref_window, conv_w, a_log, dt_bias, ref_state, torch.tensor([slot]), norm_w,
                1e-6, s.hk)[0]
    assert rel(dev.download(out), want) < 1e-5
    assert rel(dev.download(t["state"]), ref_state) < 1e-5
    assert torch.equal(dev.download(t["window"]), ref_window)


def test_gdn_walks_a_chunk_longer_than_one_dispatch(dev) -> None:
    """A 700-row chunk with 64-dim heads: llvmpipe ended the row loop after 431 rows (its loop
    limit), so the rows go in spans of one dispatch each; against the decode reference."""
    from dataclasses import replace

    s, n = replace(SHAPE, hk=2, hv=2, k=64, v=64), 700
    gen = torch.Generator().manual_seed(2)
    proj = torch.randn(n, s.gdn_proj, generator=gen)
    conv_w = torch.randn(s.conv_dim, s.width, generator=gen) * 0.5
    a_log, dt_bias = torch.randn(s.hv, generator=gen) * 0.3, torch.randn(s.hv, generator=gen)
    norm_w = torch.randn(s.v, generator=gen) * 0.2 + 1
    window = torch.randn(1, s.conv_dim, s.width - 1, generator=gen)
    state = torch.randn(1, s.hv, s.k, s.v, generator=gen) * 0.1
    t = {name: dev.upload(v) for name, v in dict(
        proj=proj, conv_w=conv_w, window=window, state=state,
        seqs=torch.tensor([[0, 0, n, 0]], dtype=torch.int32),
        params=torch.cat([a_log, dt_bias, norm_w])).items()}
    conv, out = dev.empty((n, s.conv_dim)), dev.empty((n, s.hv * s.v))
    assert len(mixers._row_spans(n, 2 * s.k + 4 * 7 + 16)) > 1

    def step(rec):
        mixers.gdn_conv(rec, s, t["proj"], t["conv_w"], t["window"], conv, t["seqs"], 1, n)
        mixers.gdn_delta(rec, s, t["proj"], conv, t["params"], t["state"], out, t["seqs"], 1,
                         1e-6, n)
    run(dev, step)
    c, z = s.conv_dim, s.hv * s.v
    want = torch.cat([gdn_decode_slots_ref(
        row[:, :c], row[:, c:c + z], row[:, c + z:c + z + s.hv], row[:, c + z + s.hv:], window,
        conv_w, a_log, dt_bias, state, torch.tensor([0]), norm_w, 1e-6, s.hk)
        for row in proj.split(1)])
    err = (dev.download(out) - want).norm(dim=-1) / want.norm(dim=-1)
    assert err.max() < 1e-4, f"first bad row {int((err >= 1e-4).nonzero()[0])}"
    assert rel(dev.download(t["state"]), state) < 1e-5

@pytest.mark.parametrize("case", ["short", "long"])
def test_attention_over_paged_blocks(dev, case) -> None:
    """Rows of two sequences (a 3-row chunk after cached positions, and one decode row), K/V
    written through scattered block tables, causal within the chunk; "long" spans several
    256-key tiles of the online softmax with a head dim over 256."""
    from dataclasses import replace

    from deltaserve.layers.rotary import Rotary, apply_rotary

    gen = torch.Generator().manual_seed(1)
    if case == "short":
        s, nb, mb = SHAPE, 8, 3
        tables = torch.tensor([[5, 1, 6]] * 3 + [[2, 7, 0]], dtype=torch.int32)
        positions = torch.tensor([9, 10, 11, 4], dtype=torch.int32)
    else:
        s, mb = replace(SHAPE, d=320), 80
        nb = 2 * mb
        perm = torch.randperm(nb, generator=gen).to(torch.int32)
        tables = torch.stack([perm[:mb]] * 3 + [perm[mb:]])
        positions = torch.tensor([600, 601, 602, 517], dtype=torch.int32)
    k_pool = torch.randn(nb, s.hkv, s.block_len, s.d, generator=gen)
    v_pool = torch.randn(nb, s.hkv, s.block_len, s.d, generator=gen)
    proj = torch.randn(4, s.attn_proj, generator=gen)
    norms = torch.randn(2 * s.d, generator=gen) * 0.1
    cos, sin = Rotary(s.rot, 1e7, torch.device("cpu")).cos_sin(positions.long(), torch.float32)
    t = {name: dev.upload(v) for name, v in dict(
        k_pool=k_pool, v_pool=v_pool, tables=tables, positions=positions, proj=proj,
        norms=norms, rope=torch.stack([cos, sin], 1)).items()}
    q_out, out = dev.empty((4, s.hq, s.d)), dev.empty((4, s.hq * s.d))

    def step(rec):
        mixers.qk_prep(rec, s, t["proj"], t["norms"], t["rope"], t["positions"], q_out,
                       t["k_pool"], t["v_pool"], t["tables"], 4, mb, 1e-6)
        mixers.attend(rec, s, q_out, t["proj"], t["k_pool"], t["v_pool"], t["positions"],
                      t["tables"], out, 4, mb)
    run(dev, step)
    qg = proj[:, :2 * s.hq * s.d].reshape(4, s.hq, 2 * s.d)
    q = rms_norm_ref(qg[..., :s.d], norms[:s.d], 1e-6, 1.0)
    k = rms_norm_ref(proj[:, 2 * s.hq * s.d:2 * s.hq * s.d + s.hkv * s.d].reshape(4, s.hkv, s.d),
                     norms[s.d:], 1e-6, 1.0)
    v = proj[:, 2 * s.hq * s.d + s.hkv * s.d:].reshape(4, s.hkv, s.d)
    q = apply_rotary(q.transpose(0, 1)[:, :, None], cos[:, None], sin[:, None])[:, :, 0]
    k = apply_rotary(k.transpose(0, 1)[:, :, None], cos[:, None], sin[:, None])[:, :, 0]
    for r in range(4):
        pos = int(positions[r])
        blk, off = tables[r, pos // s.block_len], pos % s.block_len
        k_pool[blk, :, off], v_pool[blk, :, off] = k[:, r], v[r]
    want = torch.empty(4, s.hq, s.d)
    for r in range(4):
        pos = int(positions[r])
        idx = [(int(tables[r, j // s.block_len]), j % s.block_len) for j in range(pos + 1)]
        ks = torch.stack([k_pool[b, :, o] for b, o in idx], 1)  # [HKV, T, D]
        vs = torch.stack([v_pool[b, :, o] for b, o in idx], 1)
        o = F.scaled_dot_product_attention(q[:, r:r + 1][None], ks[None], vs[None],
                                           scale=s.d ** -0.5, enable_gqa=True)[0, :, 0]
        want[r] = o * torch.sigmoid(qg[r, :, s.d:])
    assert rel(dev.download(out).reshape(4, s.hq, s.d), want) < 1e-5
    assert rel(dev.download(t["k_pool"]), k_pool) < 1e-6
    assert torch.equal(dev.download(t["v_pool"]), v_pool)


@pytest.mark.parametrize("fmt", ["f32", "f16", "int8", "int4", "q1"])
def test_packed_gemv_and_embedding_rows(dev, fmt, monkeypatch) -> None:
    """The GEMV, the tiled GEMM and the embedding gather on every format against dequantize,
    over row parts."""
    from types import SimpleNamespace

    from deltaserve.quant.schemes import FORMATS, dequantize, quantize
    from deltaserve.vulkan import weights

    w = torch.randn(300, 256) * 0.05
    if fmt in ("f32", "f16"):
        module = SimpleNamespace(weight=w, scheme=None)
        want = w if fmt == "f32" else w.half().float()
    else:
        scheme = FORMATS[fmt]
        p = quantize(w, scheme)
        module = SimpleNamespace(weight=p["weight"], scales=p["scales"], biases=p.get("biases"),
                                 scheme=scheme, in_cols=256)
        want = dequantize(p, scheme)
    monkeypatch.setattr(dev, "max_binding", 128 * 256 * 4)  # the f32 rows: three parts
    wt = weights.upload_weight(dev, module, fmt, half=fmt == "f16")
    assert wt.kind == ("affine" if fmt == "int4" else fmt)
    assert len(wt.codes.parts) == 3 if fmt == "f32" else len(wt.codes.parts) >= 1
    for rows in (1, 3, 7, 70):  # the GEMV (its widest), then the tiled GEMM over two row tiles
        x = torch.randn(rows, 256)
        xt, yt = dev.upload(x), dev.empty((rows, 300))
        run(dev, lambda rec, xt=xt, yt=yt, rows=rows: weights.gemv(rec, wt, xt, yt, rows))
        assert rel(dev.download(yt), x @ want.T) < 2e-6
    ids = torch.tensor([0, 299, 128, 5], dtype=torch.int32)
    it, et = dev.upload(ids), dev.empty((4, 256))
    run(dev, lambda rec: weights.embed(rec, wt, it, et, 4))
    assert rel(dev.download(et), want[ids.long()]) < 1e-6


def test_uniforms_and_bind_groups_are_made_once_and_let_go_with_their_buffers(dev) -> None:
    """The recorder's caches: one uniform buffer per set of values (ints and floats apart), one
    bind group per pipeline and buffers; freeing a buffer drops the groups that hold it."""
    assert dev.uniform(3, 1.5) is dev.uniform(3, 1.5)
    assert dev.uniform(3, 2.5) is not dev.uniform(3, 1.5)
    assert dev.uniform(3, 1) is not dev.uniform(3, 1.0)
    gu = dev.upload(torch.randn(2, 64))
    y = dev.empty((2, 32))
    run(dev, lambda rec: kernels.silu_mul(rec, gu, y, 2, 32))
    run(dev, lambda rec: kernels.silu_mul(rec, gu, y, 2, 32))
    holding = [k for k in dev._groups if any(e[0] is y.buffer for e in k[1])]
    assert len(holding) == 1
    want = F.silu(dev.download(gu)[:, :32]) * dev.download(gu)[:, 32:]
    assert rel(dev.download(y), want) < 1e-6
    buf = y.buffer
    dev.free(y)
    assert not [k for k in dev._groups if any(e[0] is buf for e in k[1])]


def test_argmax_as_torch(dev) -> None:
    """The greedy head's argmax: the first index of the maximum (ties), the first NaN of a row
    holding one, a row of -inf, over a vocabulary that is no multiple of 256."""
    x = torch.randn(6, 1001)
    x[1, 7] = x[1, 900] = x[1].max() + 1  # a tie: the first
    x[2, 500], x[2, 600] = float("nan"), float("nan")
    x[3] = float("-inf")
    x[4, 1000] = float("inf")
    x[5, :] = 0.5
    xt, out = dev.upload(x), dev.empty((8,), "u32")
    run(dev, lambda rec: kernels.argmax(rec, xt, out, 6, 1001, out_off=2))
    assert dev.download(out)[2:].long().tolist() == x.argmax(-1).tolist()
