"""One sequence outside the engine (validate, the quality gate, calibration, echo scoring): its
own one-slot state pool and KV blocks, advanced chunk by chunk through the model's one batched
forward, so every caller runs the kernels the engine runs.

Shapes (docs/architecture.md): T tokens of a chunk, N hidden size, V vocabulary.
"""

from __future__ import annotations

import numpy as np
import torch

from deltaserve.cache.batch import SeqChunk, StepBatch
from deltaserve.cache.pools import KVPool, PoolSizes, StatePool
from deltaserve.cache.scratch import Scratch
from deltaserve.errors import ConfigError

BLOCK_LEN = 64  # KV block length; the engine's default (CacheConfig.KV_BLOCK_LEN)


class Sequence:
    """Up to `capacity` tokens of one sequence: forward() and hidden() take the next chunk."""

    def __init__(self, model, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a sequence holds at least one token, not {capacity}")
        self.model, self.capacity, self.position = model, capacity, 0
        cfg, device = model.cfg, model.device
        num_blocks = -(-capacity // BLOCK_LEN)
        self.vk = getattr(model, "vulkan", None)
        if self.vk is not None:  # --device vulkan: its pools, its step (vulkan/runtime.py)
            from deltaserve.vulkan.pools import VulkanKVPool, VulkanStatePool

            self.states = VulkanStatePool(cfg, 1, self.vk.dev)
            self.kv = VulkanKVPool(cfg, PoolSizes(1, num_blocks, BLOCK_LEN), self.vk.dev)
        else:
            self.states = StatePool(cfg, 1, model.act_dtype, device)
            self.kv = KVPool(cfg, PoolSizes(1, num_blocks, BLOCK_LEN), model.act_dtype, device)
        self.slot = self.states.allocate()
        self.blocks = tuple(self.kv.allocate(num_blocks))
        self.scratch = Scratch()

    def _batch(self, ids) -> tuple[torch.Tensor, StepBatch]:
        """The chunk `ids` (list [T] or tensor [T] / [1,T]) as a one-chunk step at the position."""
        ids = torch.as_tensor(np.asarray(ids, np.int64) if isinstance(ids, list) else ids)
        ids = ids.reshape(-1).to(self.model.device)
        batch = StepBatch.build([self._chunk(len(ids))], self.states, self.kv, self.model.device)
        batch.scratch = self.scratch
        return ids, batch

    def _chunk(self, num: int) -> SeqChunk:
        """The next `num` tokens as a chunk of this sequence (the position moves past them)."""
        if num < 1 or self.position + num > self.capacity:
            raise ValueError(f"a chunk of {num} tokens at position {self.position} does not fit "
                             f"a sequence of capacity {self.capacity}")
        chunk = SeqChunk(self.slot, self.position, num,
                         self.blocks[: -(-(self.position + num) // BLOCK_LEN)])
        self.position += num
        return chunk

    @torch.inference_mode()
    def forward(self, ids, all_logits: bool = False) -> torch.Tensor:
        """Logits fp32 of the chunk's every token [T,V] if all_logits, else of its last [1,V]."""
        if self.vk is not None:
            ids = [int(t) for t in torch.as_tensor(np.asarray(ids)).reshape(-1)]
            num = len(ids)
            return self.vk.step([self._chunk(num)], ids,
                                list(range(num)) if all_logits else [num - 1], self)
        ids, batch = self._batch(ids)
        return self.model.forward_batch(ids, batch, all_logits=all_logits)

    @torch.inference_mode()
    def hidden(self, ids) -> torch.Tensor | None:
        """Final-normed hidden states [T,N] of the chunk (None on a pipeline stage before the
        last: it sends its output on)."""
        if self.vk is not None:
            raise ConfigError("final hidden states are not read back from --device vulkan yet")
        ids, batch = self._batch(ids)
        return self.model.hidden_batch(ids, batch)


def prompt_logits(model, ids) -> torch.Tensor:
    """Logits fp32 [T,V] of every token of ids (list [T] or tensor [T] / [1,T]) from position 0."""
    ids = torch.as_tensor(ids).reshape(-1)
    return Sequence(model, len(ids)).forward(ids, all_logits=True)
