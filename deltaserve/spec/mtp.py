"""The checkpoint's multi-token-prediction block (`mtp.*`) as a drafter.

MTP at position i reads the target's final-normed hidden h_i and the token t_{i+1}, and predicts
t_{i+2}: x = fc(cat(pre_fc_norm_embedding(embed(t_{i+1})), pre_fc_norm_hidden(h_i))) -> one gated
full-attention decoder layer (its own KV, rotary position i) -> norm -> the target's (tied) head.
Norms are Qwen3.5's zero-centred (1 + w). The order (embedding first) and the final-normed hidden
follow vLLM's qwen3_next_mtp / qwen3_5_mtp and the stdlib-19m training code
(scripts/train/model.py). Drafts past the first feed the block its own normed output as h.

Per request the drafter keeps the block's KV for every computed position: after each step it
runs the block over the new (h_i, t_{i+1}) pairs (the KV truncated first to drop last step's
draft chain); the last row's prediction is the next step's first draft.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from deltaserve.cache.state import KVCache
from deltaserve.checkpoint.loader import checkpoint_targets
from deltaserve.checkpoint.reader import TensorIndex
from deltaserve.config import FULL
from deltaserve.errors import CheckpointError
from deltaserve.layers.linear import Linear
from deltaserve.layers.norm import RMSNorm
from deltaserve.models.qwen3_5 import DecoderLayer
from deltaserve.spec.config import draftable


class MTPBlock(nn.Module):
    """Named as the checkpoint's `mtp.` tensors: fc, pre_fc_norm_{embedding,hidden}, layers.0,
    norm."""

    def __init__(self, cfg, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.full_idx = cfg.layer_types.index(FULL)  # DecoderLayer builds attention for it
        self.fc = Linear(2 * hidden, hidden, dtype)
        self.pre_fc_norm_embedding = RMSNorm(hidden, eps)
        self.pre_fc_norm_hidden = RMSNorm(hidden, eps)
        self.layers = nn.ModuleList([DecoderLayer(cfg, self.full_idx, dtype)])
        self.norm = RMSNorm(hidden, eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos_sin, kv: KVCache
                ) -> torch.Tensor:
        """embeds, hidden [1,T,N] (next tokens' embeddings, the target's hidden) at the positions
        of cos_sin, continuing kv (appended) -> normed hidden [1,T,N]: forward_steps for one
        request."""
        return self.forward_steps(embeds, hidden, cos_sin, [kv], [embeds.shape[1]])

    def forward_steps(self, embeds: torch.Tensor, hidden: torch.Tensor, cos_sin,
                      kvs: list[KVCache], lengths: list[int] | None = None) -> torch.Tensor:
        """Several requests' next positions, each continuing its own KV: embeds, hidden [1,R,N]
        (request i's lengths[i] rows back to back; one each by default), cos_sin of the R
        positions -> normed hidden [1,R,N]: fc, norms and MLP over all rows at once, attention per
        request on its own KV (the DecoderLayer's order: input norm, attention, residual,
        post-attention norm, MLP, residual)."""
        lengths = lengths or [1] * len(kvs)
        x = torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], -1)
        x = self.fc(x)
        layer, (cos, sin) = self.layers[0], cos_sin
        h, mixed, at = layer.input_layernorm(x), [], 0
        for kv, num in zip(kvs, lengths, strict=True):
            rows = slice(at, at + num)
            mixed.append(layer.self_attn(h[:, rows], (cos[rows], sin[rows]), kv))
            at += num
        x = x + torch.cat(mixed, dim=1)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)


def load_mtp(model, model_dir: Path) -> MTPBlock:
    """The checkpoint's mtp.* tensors in an MTPBlock beside `model` (same dtype and device)."""
    cfg = model.cfg
    with torch.device("meta"):
        block = MTPBlock(cfg, model.dtype)
    block = block.to_empty(device=model.device).eval()
    try:
        index = TensorIndex.scan(model_dir, lambda n: n[4:] if n.startswith("mtp.") else None,
                                 "MTP (mtp.*)")
    except CheckpointError as exc:
        raise CheckpointError(f"speculative method 'mtp' needs the checkpoint's mtp.* block: "
                              f"{exc}") from exc
    targets = checkpoint_targets(block)
    missing = sorted(set(targets) - set(index.locations))
    if missing:
        raise CheckpointError(f"the checkpoint's MTP block lacks mtp.{missing[0]}")
    for name, tensor in index.tensors(list(targets)):
        if tuple(tensor.shape) != tuple(targets[name].shape):
            raise CheckpointError(f"mtp.{name} has shape {list(tensor.shape)}, expected "
                                  f"{list(targets[name].shape)}")
        targets[name].copy_(tensor)
    return block


@dataclass(slots=True)
class _Track:
    kv: KVCache
    draft: int | None = None  # the first draft for the next step
    hidden: torch.Tensor | None = None  # [1,1,N] the block's output that predicted it
    position: int = 0  # the position that output sits at


class MTPDrafter:
    def __init__(self, model, config, model_dir: Path | None) -> None:
        self.model, self.config = model, config
        if model_dir is None:
            raise CheckpointError("speculative method 'mtp' needs the model's checkpoint folder")
        self.block = load_mtp(model, Path(model_dir))
        self._tracks: dict[str, _Track] = {}

    def _new_kv(self) -> KVCache:
        cfg, dtype = self.model.cfg, self.model.act_dtype
        empty = torch.empty(1, cfg.num_key_value_heads, 0, cfg.head_dim, dtype=dtype,
                            device=self.model.device)
        return KVCache(empty, empty.clone())

    @torch.inference_mode()
    def run_many(self, items: list[tuple[_Track, torch.Tensor, list[int], int]]) -> None:
        """The block over each track's positions start.. (items: track, hidden [T,N], next_ids [T],
        start), all their rows in one call (forward_steps): KV appended, each track's last output
        (and the position it sits at) kept on it, whose draft draft() then sets."""
        if not items:
            return
        model, ids, positions = self.model, [], []
        for track, _, next_ids, start in items:
            track.kv.length = min(track.kv.length, start)  # drop the last draft chain
            ids += next_ids
            positions += range(start, start + len(next_ids))
        cos_sin = model.rotary().cos_sin(torch.tensor(positions, device=model.device),
                                         model.act_dtype)
        hidden = torch.cat([h for _, h, _, _ in items])[None].to(model.act_dtype)
        out = self.block.forward_steps(model._embed(torch.tensor([ids], device=model.device)),
                                       hidden, cos_sin, [t.kv for t, _, _, _ in items],
                                       [len(n) for _, _, n, _ in items])
        at = 0
        for track, _, next_ids, start in items:
            at += len(next_ids)
            track.hidden, track.position = out[:, at - 1 : at], start + len(next_ids) - 1

    def step(self, tracks: list[_Track], next_ids: list[int]) -> None:
        """One further position for each track: its kept output as h, next_ids as the tokens."""
        self.run_many([(t, t.hidden[0], [i], t.position + 1)
                       for t, i in zip(tracks, next_ids, strict=True)])

    @torch.inference_mode()
    def draft(self, tracks: list[_Track]) -> None:
        """Each track's next draft from its kept output: one head call for all of them (the head
        is the drafter's largest weight: a 248k x N matrix on Qwen3.5, read once per step instead
        of once per request)."""
        if tracks:
            rows = torch.cat([t.hidden[0] for t in tracks])  # [R,N]
            for track, token in zip(tracks, self.model.head_out(rows).argmax(-1).tolist(),
                                    strict=True):
                track.draft = token

    def observe(self, plan, engine, hidden: torch.Tensor) -> None:
        """After a step: feed the block each drafting request's newly computed positions (hidden
        [T,N]: every row's final-normed hidden state, StepLogits.hidden)."""
        at, fed = 0, []
        for c in plan.chunks:
            span, at = (at, at + len(c.token_ids)), at + len(c.token_ids)
            if not draftable(engine.live(c.request_id)):
                continue
            req = engine.scheduler.get(c.request_id)
            num_new = req.num_computed - c.start_pos  # accepted rows of a verify chunk
            track = self._tracks.get(c.request_id)
            if track is None:
                track = self._tracks[c.request_id] = _Track(self._new_kv())
            next_ids = req.all_ids[c.start_pos + 1 : c.start_pos + 1 + num_new]
            fed.append((track, hidden[span[0] : span[0] + num_new], next_ids, c.start_pos))
        self.run_many(fed)  # every request's new rows through the block in one call
        self.draft([track for track, _, _, _ in fed])

    def propose_many(self, wanted: dict[str, int]) -> dict[str, list[int]]:
        """Up to wanted[rid] drafts per request: the tracked first draft, then more from the
        block's own outputs; each further draft depth is one block step over all the requests
        (attention per request, on its own KV) and one head call."""
        tracks = {rid: self._tracks[rid] for rid, num in wanted.items()
                  if num > 0 and rid in self._tracks and self._tracks[rid].draft is not None}
        firsts = {rid: (t.draft, t.hidden, t.position) for rid, t in tracks.items()}
        drafts = {rid: [t.draft] for rid, t in tracks.items()}
        while True:
            growing = [rid for rid in tracks if len(drafts[rid]) < wanted[rid]]
            if not growing:
                break
            self.step([tracks[rid] for rid in growing], [drafts[rid][-1] for rid in growing])
            self.draft([tracks[rid] for rid in growing])
            for rid in growing:
                drafts[rid].append(tracks[rid].draft)
        # the chains' KV goes at the next observe (truncated to the step's start)
        for rid, (draft, hidden, position) in firsts.items():
            tracks[rid].draft, tracks[rid].hidden, tracks[rid].position = draft, hidden, position
        return drafts

    def forget(self, rid: str) -> None:
        self._tracks.pop(rid, None)
