"""A Qwen3.5 model on the Vulkan device: its weights resident in their formats (f32, int8, 4-bit
affine, q1: vulkan/weights.py), and one engine
step (any mix of decode rows and prefill chunks) recorded as one command buffer.

The host keeps the torch model (the weights' source and the engine's bookkeeping); every step's
arithmetic runs here: embedding, per layer the norm, the mixer (GDN conv + delta rule over the
state slots, or gated attention over the paged KV pool), the MLP, and the head on the rows whose
logits the engine asks for. Pools: vulkan/pools.py.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from deltaserve.cache.batch import SeqChunk
from deltaserve.config import FULL
from deltaserve.errors import ConfigError
from deltaserve.vulkan import kernels as vk
from deltaserve.vulkan import mixers
from deltaserve.vulkan import weights as qw
from deltaserve.vulkan.device import Tensor, VulkanDevice
from deltaserve.vulkan.weights import upload_weight

# the step's scratch arrays (activations, logits rows, attention scores) kept free under
# --gpu-memory-limit; a step that needs more fails its allocation with the limit named
SCRATCH_RESERVE = 256 << 20
PLANS = 64  # recorded step plans kept (least recently used go first)


class VulkanModel:
    """Weights of `model` (Qwen3_5ForCausalLM on the host) uploaded to `dev`; the dense matrices
    as f16 where `half` (--dtype float16), norms and GDN parameters f32 always."""

    def __init__(self, model, dev: VulkanDevice, block_len: int, half: bool = False) -> None:
        cfg = self.cfg = model.cfg
        self.dev = dev
        if model.pp is not None or model.tp is not None:
            raise ConfigError("--device vulkan does not combine with --tp / --pp")
        self.shape = mixers.MixerShape(
            hk=cfg.linear_num_key_heads, hv=cfg.linear_num_value_heads,
            k=cfg.linear_key_head_dim, v=cfg.linear_value_head_dim,
            width=cfg.linear_conv_kernel_dim, hq=cfg.num_attention_heads,
            hkv=cfg.num_key_value_heads, d=cfg.head_dim, rot=cfg.rotary_dim, block_len=block_len)
        up, wt = dev.upload, lambda m, name: upload_weight(dev, m, name, half=half)
        self.embed = wt(model.model.embed_tokens, "embed_tokens")
        self.head = self.embed if cfg.tie_word_embeddings else wt(model.lm_head, "lm_head")
        self.final_norm = up(model.model.norm.weight)
        self.layers = []
        for i, layer in enumerate(model.model.layers):
            w = {"in_norm": up(layer.input_layernorm.weight),
                 "post_norm": up(layer.post_attention_layernorm.weight),
                 "gate_up": wt(layer.mlp.gate_up_proj, f"layers.{i}.mlp.gate_up"),
                 "down": wt(layer.mlp.down_proj, f"layers.{i}.mlp.down")}
            if cfg.layer_types[i] == FULL:
                a = layer.self_attn
                w.update(qkv=wt(a.qkv_proj, f"layers.{i}.qkv"),
                         out=wt(a.o_proj, f"layers.{i}.o_proj"),
                         qk_norms=up(torch.cat([a.q_norm.weight, a.k_norm.weight])))
            else:
                g = layer.linear_attn
                w.update(qkv=wt(g.in_proj, f"layers.{i}.in_proj"),
                         out=wt(g.out_proj, f"layers.{i}.out_proj"),
                         conv=up(g.conv1d.weight[:, 0].float()),
                         params=up(torch.cat([g.A_log.float(), g.dt_bias.float(),
                                              g.norm.weight.float()])))
            self.layers.append(w)
        self.rotary = model.rotary()
        self._scratch: dict[str, Tensor] = {}
        # a step's dispatches depend only on its layout (rows, sequences, the longest chunk,
        # block-table width, logit rows): recorded once per layout, then replayed
        self._plans: OrderedDict[tuple, tuple] = OrderedDict()
        self.weights_bytes = dev.allocated

    def memory_report(self, cache, host_plan):
        """cache/memory's report for what this engine holds on the GPU (the host plan's scratch
        estimate kept): weights, the pools as allocated, headroom under --gpu-memory-limit."""
        from dataclasses import replace

        pools = cache.states.bytes_per_slot() * cache.states.num_slots + \
            cache.kv.bytes_per_block() * cache.kv.num_blocks
        limit = self.dev.memory_limit
        return replace(host_plan, device=f"vulkan: {self.dev.name}",
                       weights_bytes=self.weights_bytes,
                       num_slots=cache.states.num_slots - 1,
                       kv_capacity_tokens=(cache.kv.num_blocks - 1) * cache.kv.block_len,
                       pool_bytes=pools, available_bytes=limit or 0,
                       headroom_bytes=max(0, (limit or 0) - self.dev.allocated))

    def max_kv_blocks(self, num_slots: int) -> int:
        """The KV blocks the pools may hold: one layer's K pool within one storage binding, and
        under --gpu-memory-limit what the weights, `num_slots` state slots and the step scratch
        (SCRATCH_RESERVE) leave."""
        s, cfg = self.shape, self.cfg
        per_layer = s.hkv * s.block_len * s.d * 4
        blocks = self.dev.max_binding // per_layer
        if self.dev.memory_limit is not None:
            gdn = sum(t != FULL for t in cfg.layer_types)
            state = gdn * num_slots * 4 * (s.conv_dim * (s.width - 1) + s.hv * s.k * s.v)
            left = self.dev.memory_limit - self.dev.allocated - state - SCRATCH_RESERVE
            attn = sum(t == FULL for t in cfg.layer_types)
            blocks = min(blocks, left // max(1, 2 * attn * per_layer))
        if blocks < 2:
            raise ConfigError(f"--gpu-memory-limit {self.dev.memory_limit / 2**30:.2f} GiB leaves "
                              f"no KV cache after the weights ({self.dev.allocated / 2**30:.2f} "
                              f"GiB) and {num_slots} state slots: raise it or lower "
                              "--max-num-seqs")
        return blocks

    def _buf(self, name: str, shape: tuple[int, ...], dtype: str = "f32") -> Tensor:
        """A step scratch array of at least `shape`'s size (kept and regrown by name)."""
        t = self._scratch.get(name)
        need = int(np.prod(shape))
        if t is None or int(np.prod(t.shape)) < need or t.dtype != dtype:
            if t is not None:
                self.dev.free(t)
            t = self._scratch[name] = self.dev.empty((max(need, 1),), dtype)
        return Tensor(tuple(shape), dtype, [(0, shape[0], t.buffer)])

    def _inputs(self, chunks: list[SeqChunk], ids: list[int]) -> dict[str, Tensor]:
        """The step's index arrays written to the device: ids, positions, rotary rows, per-row
        block tables, the sequence table."""
        rows = len(ids)
        positions = np.concatenate([np.arange(c.start_pos, c.start_pos + c.num_tokens)
                                    for c in chunks]).astype(np.int64)
        width = max(len(c.block_table) for c in chunks)
        tables = np.zeros((rows, width), np.uint32)
        seqs = np.zeros((len(chunks), 4), np.uint32)
        r = 0
        for i, c in enumerate(chunks):
            tables[r:r + c.num_tokens, :len(c.block_table)] = c.block_table
            seqs[i, :3] = (c.slot, r, c.num_tokens)
            r += c.num_tokens
        cos, sin = self.rotary.cos_sin(torch.from_numpy(positions), torch.float32)
        arrays = {"ids": np.asarray(ids, np.uint32), "pos": positions.astype(np.uint32),
                  "tables": tables, "seqs": seqs,
                  "rope": torch.stack([cos, sin], 1).numpy()}
        out = {}
        for name, arr in arrays.items():
            t = self._buf(name, arr.shape, "f32" if arr.dtype == np.float32 else "u32")
            self.dev.write(t, arr)
            out[name] = t
        out["width"] = width
        return out

    def max_context(self) -> int | None:
        """The longest context the attention kernel walks correctly on this driver (None: no
        limit): on llvmpipe its key-tile loop, nested loops counted, stays within the loop
        limit (mixers.LOOP_BUDGET)."""
        if not self.dev.loop_limited:
            return None
        s = self.shape
        per_tile = s.d + 256 * -(-s.d // 256) + 48
        return mixers.LOOP_BUDGET // per_tile * 256

    def max_rows(self) -> int:
        """The most rows one submission holds: its widest activation row within one storage
        binding (a longer step runs in pieces, each chunk's rows in order)."""
        s, cfg = self.shape, self.cfg
        widest = max(2 * cfg.intermediate_size, s.gdn_proj, s.attn_proj, s.hv * s.v,
                     s.hq * s.d, cfg.hidden_size)
        return max(1, min(4096, self.dev.max_binding // (4 * widest)))

    def step(self, chunks: list[SeqChunk], ids: list[int], logit_rows: list[int], pools,
             greedy: bool = False) -> torch.Tensor:
        """Runs the step; returns the f32 logits [len(logit_rows), vocab] of those rows
        (ascending), or where `greedy` their argmax tokens [len(logit_rows)] (int64), the logits
        left on the GPU."""
        cap = self.max_rows()
        if len(ids) <= cap:
            return self._submit(chunks, ids, logit_rows, pools, greedy)
        out, row = [], 0
        for c in chunks:  # sequences are independent; a chunk's pieces run in order
            for off in range(0, c.num_tokens, cap):
                num = min(cap, c.num_tokens - off)
                lo = row + off
                piece = SeqChunk(c.slot, c.start_pos + off, num, c.block_table)
                want = [r - lo for r in logit_rows if lo <= r < lo + num]
                got = self._submit([piece], ids[lo:lo + num], want or [num - 1], pools, greedy)
                out.append(got[:len(want)])
            row += c.num_tokens
        return torch.cat(out)

    def _submit(self, chunks: list[SeqChunk], ids: list[int], logit_rows: list[int], pools,
                greedy: bool) -> torch.Tensor:
        """One submission of the step (rows within max_rows): its inputs written, its
        dispatches recorded (or replayed from the plan of the same layout), its outputs read."""
        dev = self.dev
        inp = self._inputs(chunks, ids)
        sels = self._selections(logit_rows)
        key = (len(ids), inp["width"], tuple(c.num_tokens for c in chunks), tuple(logit_rows),
               greedy, id(pools))
        plan = self._plans.get(key)
        rec = dev.recorder()
        if plan is not None and plan[0] == dev.generation and dev.profiler is None:
            self._plans.move_to_end(key)
            rec.replay(plan[1])
            outputs = plan[2]
        else:
            rec.ops = []
            outputs = self._record(rec, chunks, len(ids), inp, sels, greedy, pools)
            self._plans[key] = (dev.generation, rec.ops, outputs)
            if len(self._plans) > PLANS:
                self._plans.popitem(last=False)
        rec.submit()
        if greedy:
            return dev.download(outputs[0]).long()
        return torch.cat([dev.download(t) for t in outputs])

    def _record(self, rec, chunks: list[SeqChunk], rows: int, inp: dict, sels: list[Tensor],
                greedy: bool, pools) -> list[Tensor]:
        """The step's dispatches into `rec`; the tensors the head leaves its results in."""
        cfg, s = self.cfg, self.shape
        n = cfg.hidden_size
        width = inp["width"]
        x, h = self._buf("x", (rows, n)), self._buf("h", (rows, n))
        mixed = self._buf("mixed", (rows, n))
        rec.section = "embed"
        qw.embed(rec, self.embed, inp["ids"], x, rows)
        vk.rms_norm(rec, x, self.layers[0]["in_norm"], h, rows, n, cfg.rms_norm_eps, 1.0)
        for i, w in enumerate(self.layers):
            rec.section = "attn" if cfg.layer_types[i] == FULL else "gdn"
            if cfg.layer_types[i] == FULL:
                proj = self._buf("aproj", (rows, s.attn_proj))
                o = self._buf("ao", (rows, s.hq * s.d))
                qw.gemv(rec, w["qkv"], h, proj, rows)
                q = self._buf("q", (rows, s.hq, s.d))
                mixers.qk_prep(rec, s, proj, w["qk_norms"], inp["rope"], inp["pos"], q,
                               pools.kv.k[i], pools.kv.v[i], inp["tables"], rows, width,
                               cfg.rms_norm_eps)
                mixers.attend(rec, s, q, proj, pools.kv.k[i], pools.kv.v[i], inp["pos"],
                              inp["tables"], o, rows, width)
            else:
                proj = self._buf("gproj", (rows, s.gdn_proj))
                o = self._buf("go", (rows, s.hv * s.v))
                qw.gemv(rec, w["qkv"], h, proj, rows)
                conv = self._buf("conv", (rows, s.conv_dim))
                longest = max(c.num_tokens for c in chunks)
                mixers.gdn_conv(rec, s, proj, w["conv"], pools.states.conv[i], conv,
                                inp["seqs"], len(chunks), longest)
                mixers.gdn_delta(rec, s, proj, conv, w["params"], pools.states.recurrent[i], o,
                                 inp["seqs"], len(chunks), cfg.rms_norm_eps, longest)
            qw.gemv(rec, w["out"], o, mixed, rows)
            rec.section = "mlp"
            vk.rms_norm(rec, mixed, w["post_norm"], h, rows, n, cfg.rms_norm_eps, 1.0, residual=x)
            inter = cfg.intermediate_size
            gu, act = self._buf("gu", (rows, 2 * inter)), self._buf("act", (rows, inter))
            qw.gemv(rec, w["gate_up"], h, gu, rows)
            vk.silu_mul(rec, gu, act, rows, inter)
            qw.gemv(rec, w["down"], act, mixed, rows)
            norm = self.layers[i + 1]["in_norm"] if i + 1 < len(self.layers) else self.final_norm
            vk.rms_norm(rec, mixed, norm, h, rows, n, cfg.rms_norm_eps, 1.0, residual=x)
        return self._head(rec, h, rows, sels, greedy)

    def _selections(self, logit_rows: list[int]) -> list[Tensor]:
        """The rows the head reads, written in groups whose logits fit one binding each."""
        per = max(1, self.dev.max_binding // (4 * self.cfg.vocab_size))
        sels = []
        for g, lo in enumerate(range(0, len(logit_rows), per)):
            part = logit_rows[lo:lo + per]
            sels.append(self._buf(f"sel{g}", (len(part),), "u32"))
            self.dev.write(sels[-1], np.asarray(part, np.uint32))
        return sels

    def _head(self, rec, h: Tensor, rows: int, sels: list[Tensor], greedy: bool
              ) -> list[Tensor]:
        """The head on the selected rows of h, a group of rows at a time: the logits tensors
        per group, or where `greedy` the one tensor of their argmax tokens."""
        cfg, n = self.cfg, self.cfg.hidden_size
        groups = []
        rec.section = "head"
        tokens = self._buf("tokens", (sum(t.shape[0] for t in sels),), "u32") if greedy else None
        first = 0  # the group's first row among all the selected rows
        for g, sel in enumerate(sels):
            m = sel.shape[0]
            hs = self._buf(f"hsel{g}", (m, n))
            vk.embed(rec, Tensor((rows, n), "f32", h.parts), sel, hs, m)
            groups.append(self._buf(f"logits{g}", (m, cfg.vocab_size)))
            qw.gemv(rec, self.head, hs, groups[-1], m)
            if greedy:
                vk.argmax(rec, groups[-1], tokens, m, cfg.vocab_size, first)
            first += m
        return [tokens] if greedy else groups
