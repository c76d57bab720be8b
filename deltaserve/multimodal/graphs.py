"""The vision tower replayed from CUDA graphs: a 448² image is ~290 kernels for ~2 ms of GPU work,
so eager calls are bound by Python's launch time (5.8 ms on an H200). One graph per (piece grids,
mode); a grid is captured the second time it is seen (a one-off shape runs eagerly, as before),
and at most MAX_GRAPHS are kept, least recently used out.

Everything the forward builds on the host per grid (position ids, window and merge orders) comes
from positions.device_index's memo, so the captured forward copies nothing from the host; the
pixels go into a static input buffer and the features come out of a static one (cloned).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from deltaserve.engine.cuda_graph import capture
from deltaserve.multimodal.positions import recording_indices

MAX_GRAPHS = 8
MAX_SEEN = 1024  # grids remembered as seen once (then forgotten all at once)
_Key = tuple[tuple[tuple[int, int], ...], str, torch.dtype]


class TowerGraphs:
    def __init__(self, model) -> None:
        self.model = model
        # key -> (graph, static input, static output, the index tensors the graph reads)
        self.graphs: OrderedDict[_Key, tuple] = OrderedDict()
        self.seen: set[_Key] = set()
        self.pool = torch.cuda.graph_pool_handle()
        self.num_captures = 0

    @torch.inference_mode()  # static buffers made and written in one mode, whatever the caller's
    def run(self, pixels: torch.Tensor, grids: list[tuple[int, int]], mode: str) -> torch.Tensor:
        """pixels [channels, P, L*P] on the tower's device and dtype -> features (a fresh tensor,
        equal bit for bit to the eager forward's)."""
        key = (tuple(grids), mode, pixels.dtype)
        entry = self.graphs.get(key)
        if entry is None:
            if key not in self.seen:
                if len(self.seen) >= MAX_SEEN:
                    self.seen.clear()
                self.seen.add(key)
                return self.model._run(pixels, grids, mode, None)
            entry = self._capture(pixels, grids, mode)
            self.graphs[key] = entry
            while len(self.graphs) > MAX_GRAPHS:  # an evicted grid needs two sightings again
                self.seen.discard(self.graphs.popitem(last=False)[0])
        self.graphs.move_to_end(key)
        graph, static_in, static_out, _ = entry
        static_in.copy_(pixels)
        graph.replay()
        return static_out.clone()

    def _capture(self, pixels: torch.Tensor, grids: list[tuple[int, int]], mode: str):
        static_in = pixels.clone()
        with recording_indices() as indices:  # warm-up and capture read the same memo entries
            graph, static_out = capture(lambda: self.model._run(static_in, grids, mode, None),
                                        self.pool, warmups=1)
        self.num_captures += 1
        # the graph reads those index tensors by address: it holds them, whatever the memo drops
        return graph, static_in, static_out, indices
