"""Load-time memory plan: what the weights take, what one sequence's state and one token of KV
cost, how many tokens the KV pool holds, and the headroom left; and the fits-check that refuses a
configuration with the largest context that does fit instead of running out of memory later.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from deltaserve.errors import CapacityError

GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class MemoryReport:
    device: str
    weights_bytes: int
    state_bytes_per_seq: int  # GDN conv windows + recurrent matrices, every layer
    kv_bytes_per_token: int  # K and V of every attention layer
    num_slots: int
    kv_capacity_tokens: int
    pool_bytes: int  # state slots + KV blocks
    scratch_bytes: int  # activations / dequantized weights of one step (estimate)
    available_bytes: int  # free device memory (CPU: MemAvailable) when the pools are planned
    headroom_bytes: int

    def summary(self) -> str:
        return (f"memory ({self.device}): weights {self.weights_bytes / GiB:.2f} GiB, state "
                f"{self.state_bytes_per_seq / 2**20:.1f} MiB/sequence x {self.num_slots} slots, KV "
                f"{self.kv_capacity_tokens:,} tokens ({self.kv_bytes_per_token / 1024:.1f} KiB/token), "
                f"pools {self.pool_bytes / GiB:.2f} GiB, scratch {self.scratch_bytes / GiB:.2f} GiB, "
                f"headroom {self.headroom_bytes / GiB:.2f} GiB")


def available_bytes(device: torch.device, share: float | None = None) -> int:
    """Free memory now; on CUDA with `share` (--gpu-memory-utilization), what is left of that
    share of the whole card after everything held already (this process's weights among it)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return free if share is None else max(0, int(share * total) - (total - free))
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62  # unknown: do not refuse


def fit_blocks(per_slot: int, per_block: int, block_len: int, num_slots: int, want_blocks: int,
               min_blocks: int, scratch: int, available: int) -> int:
    """KV blocks to allocate: `want_blocks` if they fit beside the slots and scratch, else as many
    as fit, but never fewer than `min_blocks` (one max_model_len sequence): then refuse, naming
    the largest context that fits."""
    free = available - scratch - num_slots * per_slot
    fits = max(0, free // max(per_block, 1))
    if fits >= want_blocks:
        return want_blocks
    if fits >= min_blocks:
        return fits
    largest = fits * block_len
    raise CapacityError(
        f"the KV cache for a {min_blocks * block_len:,}-token context does not fit: "
        f"{available / GiB:.2f} GiB free, {num_slots} state slots take "
        f"{num_slots * per_slot / GiB:.2f} GiB and scratch {scratch / GiB:.2f} GiB; the largest "
        f"context that fits is {largest:,} tokens (pass --max-model-len {largest}, fewer "
        f"--max-num-seqs, or a smaller --max-num-batched-tokens)" if largest > 0 else
        f"not even one sequence's state fits: {available / GiB:.2f} GiB free, {num_slots} state "
        f"slots need {num_slots * per_slot / GiB:.2f} GiB (pass fewer --max-num-seqs)"
    )


def weights_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def activation_bytes(model, num_tokens: int) -> int:
    """A step's activations, roughly: the widest ones (vocab logits of the step's sampling rows
    aside) times the tokens in the step."""
    cfg = model.cfg
    return num_tokens * max(cfg.intermediate_size * 2, cfg.hidden_size * 8) * 4 * 4


def scratch_estimate(model, max_batched_tokens: int) -> int:
    """One step's transient memory, roughly: its activations and one dequantized/widened fp32
    weight."""
    largest_weight = max((p.numel() for p in model.parameters()), default=0)
    return activation_bytes(model, max_batched_tokens) + min(largest_weight * 4, 64 * 2**20 * 4)


def unit_bytes(model, block_len: int, kv_dtype: torch.dtype | None = None) -> tuple[int, int]:
    """(bytes of one state slot, bytes of one KV block) for `model`'s layers and dtypes."""
    from deltaserve.config import FULL

    cfg, act = model.cfg, torch.empty((), dtype=model.act_dtype).element_size()
    kv = torch.empty((), dtype=kv_dtype or model.act_dtype).element_size()
    per_slot = per_block = 0
    for layer_type in cfg.layer_types:
        if layer_type == FULL:
            per_block += 2 * cfg.num_key_value_heads * block_len * cfg.head_dim * kv
        else:
            per_slot += cfg.conv_dim * (cfg.linear_conv_kernel_dim - 1) * act
            per_slot += (cfg.linear_num_value_heads * cfg.linear_key_head_dim
                         * cfg.linear_value_head_dim * 4)
    return per_slot, per_block


def plan(model, max_model_len: int, num_slots: int, kv_cache_bytes: int, block_len: int,
         max_batched_tokens: int, kv_dtype: torch.dtype | None = None, graph_bytes: int = 0,
         memory_share: float | None = None) -> tuple[int, MemoryReport]:
    """KV blocks for the pools, and the report. Every slot may reach max_model_len until
    kv_cache_bytes binds; at least one max_model_len sequence always. On CUDA (memory allocated
    up front) the blocks are cut to what fits, or refused below one sequence; CPU pools are
    touched only as used, so there the report is advice. graph_bytes: what the long prefill
    graphs keep (engine/prefill_graph.graph_scratch_bytes), counted as scratch too. memory_share
    (CUDA, --gpu-memory-utilization): no kv_cache_bytes cap; the KV cache takes what that share of
    the card leaves, up to every slot at max_model_len."""
    device = model.device
    per_slot, per_block = unit_bytes(model, block_len, kv_dtype)
    per_seq = -(-max_model_len // block_len)
    cap = kv_cache_bytes // max(per_block, 1) if memory_share is None else per_seq * num_slots
    want = max(per_seq, min(per_seq * num_slots, cap))
    scratch = scratch_estimate(model, max_batched_tokens) + graph_bytes
    avail = available_bytes(device, memory_share)
    blocks = want
    if device.type == "cuda":
        blocks = fit_blocks(per_slot, per_block, block_len, num_slots, want, per_seq, scratch, avail)
    pools = num_slots * per_slot + blocks * per_block
    report = MemoryReport(str(device), weights_bytes(model), per_slot, per_block // block_len,
                          num_slots, blocks * block_len, pools, scratch, avail,
                          avail - pools - scratch)
    return blocks, report
