"""The model runner: turns a scheduler plan into a Step and runs it on the first executor that
takes it (engine/executors.py), which returns the logits of the chunks that sample and stores
the prefix snapshots the forward captured."""

from __future__ import annotations

from collections.abc import Mapping

from deltaserve.cache.manager import CacheManager
from deltaserve.engine.executors import Eager, NativeDecode, VulkanStep
from deltaserve.engine.request import ImageInputs
from deltaserve.engine.scheduler import StepPlan
from deltaserve.engine.step import Feed, Step, StepLogits
from deltaserve.env import env
from deltaserve.ops.attention import SPLIT_MIN_QUERIES, warm_split_attention
from deltaserve.ops.gdn_prefill import SCAN_MAX_TOKENS


class ModelRunner:
    """Runs each step the scheduler plans on the executor that takes it (engine/executors.py).
    keep_hidden: every step's StepLogits carries every row's final hidden (the MTP drafter's
    input); the graph executors, whose static outputs hold no hidden rows, are then not built.
    rollback: SpeculativeConfig.rollback, for steps with verify chunks."""

    def __init__(self, model, cache: CacheManager, greedy_head: bool = False,
                 max_prefill_chunk: int = 0, keep_hidden: bool = False,
                 rollback: str = "recompute") -> None:
        self.model, self.cache, self.greedy_head = model, cache, greedy_head
        self.rollback = rollback
        if max_prefill_chunk > SCAN_MAX_TOKENS:
            _tune_prefill_scan(model, max_prefill_chunk)
        if max_prefill_chunk >= SPLIT_MIN_QUERIES and model.cfg.num_attention_heads:
            cfg = model.cfg  # chunks behind cached keys may take the split: load cuDNN now
            warm_split_attention(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                 model.act_dtype, model.device)
        # --device vulkan: every step on the Vulkan executor (the pools live on that device)
        self.vulkan = VulkanStep(model, greedy_head) if getattr(model, "vulkan", None) else None
        self.eager = Eager(model, greedy_head, keep_hidden)
        self.native = NativeDecode(model, greedy_head, keep_hidden) \
            if model.device.type == "cpu" else None
        self.graphs = None
        # pipeline stages decode eagerly: their send/recv/broadcast are not captured in graphs
        if model.device.type == "cuda" and env().cuda_graphs and getattr(model, "pp", None) is None \
                and not keep_hidden:
            from deltaserve.engine.cuda_graph import DecodeGraphs

            self.graphs = DecodeGraphs(model, cache, cache.spare_slot, cache.spare_block,
                                       greedy_head)
        self.prefill_graphs = None  # short single-chunk prefill steps (engine/prefill_graph.py)
        if self.graphs is not None:
            from deltaserve.engine import prefill_graph

            if prefill_graph.usable(model):
                self.prefill_graphs = prefill_graph.PrefillGraphs(
                    model, cache, cache.spare_slot, cache.spare_block, greedy_head,
                    max_prefill_chunk or None)

    def execute(self, plan: StepPlan, all_ids: Mapping[str, list[int]],
                feed: Feed | None = None,
                images: Mapping[str, ImageInputs] | None = None,
                hidden: bool = False) -> StepLogits:
        """all_ids: every multi-token chunk's request's key ids (Request.key_ids: prefix keys
        are hashes of them). feed (decode-only plans): (device tokens, rows of this plan, rows of
        those tokens): those rows' input ids come from the device, never read back
        (engine/overlap.py). images: the planned requests that have image placeholders.
        Returns request id -> next-token logits [vocab] fp32 for the chunks with sample=True,
        left on the device (engine/executors.py: the first executor that takes the step).
        hidden: the eager executor runs it, every row's final hidden kept (prompt logprobs)."""
        step = Step(plan, all_ids, feed, images or {}, self.cache, self.model.device,
                    self.rollback)
        if self.vulkan is not None:
            return self.vulkan.execute_step(step)
        if hidden:
            return self.eager.execute_step(step, hidden=True)
        for executor in (self.graphs, self.prefill_graphs, self.native, self.eager):
            out = None if executor is None else executor.execute_step(step)
            if out is not None:
                return out
        raise AssertionError("the eager executor takes every step")


def _tune_prefill_scan(model, max_prefill_chunk: int) -> None:
    """fla's stages (the GDN scan of chunks over SCAN_MAX_TOKENS) picked their launch configs at a
    prefill length: ops/fla_scan.tune, once per process, before the first request."""
    from deltaserve.ops import fla_scan
    from deltaserve.ops.gdn_prefill import GDN_PREFILL, case_at

    cfg = model.cfg
    if not cfg.linear_num_value_heads or model.device.type != "cuda" or fla_scan.tuned is not None:
        return
    case = case_at(max_prefill_chunk, model.act_dtype, model.device, cfg)
    if GDN_PREFILL.choose(case).name.startswith("fla_stages"):
        fla_scan.tuned = max_prefill_chunk
        fla_scan.tune(cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                      cfg.linear_key_head_dim, cfg.linear_value_head_dim, max_prefill_chunk,
                      model.act_dtype, model.device)
