"""The MTP block against a plain torch reference written from the formula (transformers has no MTP
forward): x = fc(cat(norm_e(embed(t+1)), norm_h(h))), one gated full-attention layer, norm; all
norms (1 + w), partial NeoX rotary, GQA, sigmoid output gate (reference/formats.md §2.2, §2.5)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from deltaserve.cache.state import KVCache
from deltaserve.spec.mtp import load_mtp


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w.float())


def rope(x: torch.Tensor, rot_dim: int, theta: float) -> torch.Tensor:
    """x [T,H,D]: rotate-half on dims [0, rot_dim) at positions 0..T-1."""
    inv = theta ** (-torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)
    ang = torch.arange(x.shape[0], dtype=torch.float64)[:, None] * inv[None]
    cos, sin = ang.cos().float()[:, None], ang.sin().float()[:, None]
    x1, x2 = x[..., : rot_dim // 2], x[..., rot_dim // 2 : rot_dim]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rot_dim:]], -1)


def mtp_reference(w: dict[str, torch.Tensor], cfg, embed_w, hidden, next_ids) -> torch.Tensor:
    eps, num_tokens = cfg.rms_norm_eps, len(next_ids)
    hq, hkv, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    lin = lambda x, name: x @ w[name].float().T  # noqa: E731
    e = embed_w[next_ids].float()
    x = lin(torch.cat([rms(e, w["pre_fc_norm_embedding.weight"], eps),
                       rms(hidden, w["pre_fc_norm_hidden.weight"], eps)], -1), "fc.weight")
    p = "layers.0."
    h = rms(x, w[p + "input_layernorm.weight"], eps)
    qg = lin(h, p + "self_attn.q_proj.weight").view(num_tokens, hq, 2 * dim)
    q, gate = qg[..., :dim], qg[..., dim:]
    k = lin(h, p + "self_attn.k_proj.weight").view(num_tokens, hkv, dim)
    v = lin(h, p + "self_attn.v_proj.weight").view(num_tokens, hkv, dim)
    rot = int(dim * cfg.partial_rotary_factor)
    q = rope(rms(q, w[p + "self_attn.q_norm.weight"], eps), rot, cfg.rope_theta)
    k = rope(rms(k, w[p + "self_attn.k_norm.weight"], eps), rot, cfg.rope_theta)
    k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    scores = torch.einsum("thd,shd->hts", q, k) * dim**-0.5
    causal = torch.ones(num_tokens, num_tokens, dtype=torch.bool).tril()
    att = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    o = torch.einsum("hts,shd->thd", att, v).reshape(num_tokens, hq * dim)
    gated = o * torch.sigmoid(gate.reshape(num_tokens, hq * dim))
    x = x + lin(gated, p + "self_attn.o_proj.weight")
    m = rms(x, w[p + "post_attention_layernorm.weight"], eps)
    up = F.silu(lin(m, p + "mlp.gate_proj.weight")) * lin(m, p + "mlp.up_proj.weight")
    x = x + lin(up, p + "mlp.down_proj.weight")
    return rms(x, w["norm.weight"], eps)


def test_mtp_block_matches_the_formula(tiny_llm, tiny_dir) -> None:
    model, cfg = tiny_llm.model, tiny_llm.config
    weights = {}
    for file in tiny_dir.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            weights.update({k[4:]: f.get_tensor(k) for k in f.keys() if k.startswith("mtp.")})
    assert len(weights) == 15
    block = load_mtp(model, tiny_dir)
    g = torch.Generator().manual_seed(0)
    num_tokens = 12
    hidden = torch.randn(num_tokens, cfg.hidden_size, generator=g)
    next_ids = torch.randint(0, 1000, (num_tokens,), generator=g)
    want = mtp_reference(weights, cfg, model.model.embed_tokens.weight, hidden, next_ids)

    empty = torch.empty(1, cfg.num_key_value_heads, 0, cfg.head_dim)
    kv = KVCache(empty, empty.clone())

    def run(lo: int, hi: int) -> torch.Tensor:  # positions [lo, hi), continuing kv
        cos_sin = model.rotary().cos_sin(torch.arange(lo, hi), torch.float32)
        with torch.inference_mode():
            return block(model._embed(next_ids[None, lo:hi]), hidden[None, lo:hi], cos_sin, kv)[0]

    got = torch.cat([run(0, 9), run(9, 10), run(10, 12)])  # a chunk, then steps: one KV
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    assert kv.length == num_tokens


def test_batched_drafts_equal_one_request_at_a_time(tiny_llm, tiny_dir) -> None:
    """propose_many (the block per request, one head call per draft depth over all requests)
    gives each request the chain it gets alone, and leaves each track as it found it."""
    from types import SimpleNamespace

    from deltaserve.spec.mtp import MTPDrafter, _Track

    model, cfg = tiny_llm.model, tiny_llm.config
    drafter = MTPDrafter(model, SimpleNamespace(), tiny_dir)
    g = torch.Generator().manual_seed(1)
    inputs = {rid: (torch.randn(n, cfg.hidden_size, generator=g),
                    torch.randint(0, 1000, (n,), generator=g).tolist())
              for rid, n in (("a", 7), ("b", 4), ("c", 5))}
    wanted = {"a": 3, "b": 2, "c": 0}

    def run(track: _Track, hidden: torch.Tensor, next_ids: list[int], start: int) -> None:
        """One request through the block as the drafter ran it before batching."""
        track.kv.length = min(track.kv.length, start)
        cos_sin = model.rotary().cos_sin(torch.arange(start, start + len(next_ids)),
                                         torch.float32)
        with torch.inference_mode():
            out = drafter.block(model._embed(torch.tensor([next_ids])), hidden[None],
                                cos_sin, track.kv)
        track.hidden, track.position = out[:, -1:], start + len(next_ids) - 1

    def fed(rids) -> dict[str, _Track]:
        tracks = {rid: _Track(drafter._new_kv()) for rid in rids}
        for rid, track in tracks.items():
            run(track, *inputs[rid], 0)
        return tracks

    alone = {}
    for rid in ("a", "b"):  # the chain as the drafter ran it before: block and head per step
        track = fed([rid])[rid]
        chain = [int(model.head_out(track.hidden[0]).argmax(-1))]
        while len(chain) < wanted[rid]:
            run(track, track.hidden[0], [chain[-1]], track.position + 1)
            chain.append(int(model.head_out(track.hidden[0]).argmax(-1)))
        alone[rid] = chain
    drafter._tracks = fed(inputs)
    drafter.draft(list(drafter._tracks.values()))
    before = {rid: (t.draft, t.position, t.hidden) for rid, t in drafter._tracks.items()}
    assert drafter.propose_many(wanted) == alone and len(alone["a"]) == 3
    for rid, track in drafter._tracks.items():  # each track as it was before the chains
        draft, position, hidden = before[rid]
        assert (track.draft, track.position) == (draft, position)
        assert track.hidden is hidden


@pytest.mark.parametrize("rows", [(1, 1, 1), (2, 1, 3)], ids=["draft-steps", "observe"])
def test_block_steps_over_requests_equal_one_at_a_time(tiny_llm, tiny_dir, rows) -> None:
    """forward_steps: the next rows of three requests with KV of different lengths (one each, as
    a draft depth; several, as after a verify step), fc / norms / MLP over all rows at once:
    each row within 1e-5 of forward() on that request alone, each KV appended by its rows."""
    model, cfg = tiny_llm.model, tiny_llm.config
    block = load_mtp(model, tiny_dir)
    g = torch.Generator().manual_seed(2)

    def kv_of(length: int) -> KVCache:
        empty = torch.empty(1, cfg.num_key_value_heads, 0, cfg.head_dim)
        kv = KVCache(empty, empty.clone())
        ids = torch.randint(0, 1000, (1, length), generator=g)
        cos_sin = model.rotary().cos_sin(torch.arange(length), torch.float32)
        with torch.inference_mode():
            block(model._embed(ids), torch.randn(1, length, cfg.hidden_size, generator=g),
                  cos_sin, kv)
        return kv

    lengths = (5, 1, 9)
    kvs, alone = [kv_of(n) for n in lengths], [kv_of(n) for n in lengths]
    for a, b in zip(kvs, alone, strict=True):  # the same history in both
        b.k, b.v, b.length = a.k.clone(), a.v.clone(), a.length
    total = sum(rows)
    ids = torch.randint(0, 1000, (1, total), generator=g)
    hidden = torch.randn(1, total, cfg.hidden_size, generator=g)
    positions = [n + j for n, r in zip(lengths, rows, strict=True) for j in range(r)]
    cos_sin = model.rotary().cos_sin(torch.tensor(positions), torch.float32)
    with torch.inference_mode():
        got = block.forward_steps(model._embed(ids), hidden, cos_sin, kvs, list(rows))[0]
        at = 0
        for i, (n, r) in enumerate(zip(lengths, rows, strict=True)):
            span = slice(at, at + r)
            one = model.rotary().cos_sin(torch.arange(n, n + r), torch.float32)
            want = block(model._embed(ids[:, span]), hidden[:, span], one, alone[i])[0]
            assert ((got[span] - want).norm() / want.norm()).item() <= 1e-5
            assert kvs[i].length == alone[i].length == n + r
            at += r
