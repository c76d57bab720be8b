"""Position ids of image pieces: each patch's nearest bucket on the tower's square position table.

NOTE: the bucket boundaries k/S and the coordinates i/h meet in exact rational ties (10/28 = 25/70);
which side a tie falls on is decided by float32 rounding inside these torch operators, so the ids
are computed with the very operators transformers uses, never with exact fractions.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict

import torch


def bucket_boundaries(num_patches_per_side: int) -> torch.Tensor:
    """[S - 1] float32: 1/S, 2/S, ... (as torch.arange rounds them)."""
    step = 1 / num_patches_per_side
    return torch.arange(step, 1.0, step, dtype=torch.float32)


def piece_position_ids(
    grid_h: int, grid_w: int, num_patches_per_side: int, boundaries: torch.Tensor | None = None
) -> torch.Tensor:
    """[grid_h * grid_w] int64 ids into the S*S table, patches row-major."""
    if boundaries is None:
        boundaries = bucket_boundaries(num_patches_per_side)
    # the reference divides an int64 arange in the default dtype (float32); pinned here so a
    # caller's torch.set_default_dtype cannot move a tie
    rows = torch.arange(grid_h, dtype=torch.float32) / grid_h  # [grid_h]
    cols = torch.arange(grid_w, dtype=torch.float32) / grid_w  # [grid_w]
    rows = torch.bucketize(rows, boundaries, right=True)
    cols = torch.bucketize(cols, boundaries, right=True)
    return (rows[:, None] * num_patches_per_side + cols).flatten()


def position_ids(grid_hw: list[tuple[int, int]], num_patches_per_side: int) -> torch.Tensor:
    """[sum(h * w)] int64: the ids of every piece, in packing order."""
    boundaries = bucket_boundaries(num_patches_per_side)
    return torch.cat(
        [piece_position_ids(h, w, num_patches_per_side, boundaries) for h, w in grid_hw]
    )


_INDEX_MEMO: OrderedDict[tuple, torch.Tensor] = OrderedDict()
_MEMO_LOCK = threading.Lock()
MAX_MEMO_ENTRIES = 64  # distinct (kind, grids, device) index tensors kept, least recently used out
_recording = threading.local()  # .used: the list recording_indices() fills, if any


def device_index(kind: object, grid_hw: list[tuple[int, int]], device: torch.device, build
                 ) -> torch.Tensor:
    """build() (a host index tensor for these grids) on `device`, made once per (kind, grids,
    device): no host-to-device copy per call, so the tower can be captured in a CUDA graph
    (multimodal/graphs.py, which warms the memo up first). Callers must not write into it."""
    key = (kind, tuple(grid_hw), str(device))
    with _MEMO_LOCK:
        found = _INDEX_MEMO.get(key)
        if found is not None:
            _INDEX_MEMO.move_to_end(key)
    if found is None:
        if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"index {key[:2]} missing while a CUDA graph is captured (a "
                               "host-to-device copy cannot be captured): warm the memo up first")
        found = build().to(device)
        with _MEMO_LOCK:
            _INDEX_MEMO[key] = found
            while len(_INDEX_MEMO) > MAX_MEMO_ENTRIES:
                _INDEX_MEMO.popitem(last=False)
    used = getattr(_recording, "used", None)
    if used is not None:
        used.append(found)
    return found


@contextlib.contextmanager
def recording_indices():
    """Collects every tensor device_index hands out in this thread meanwhile (a captured graph
    reads them by address and keeps them alive, whatever the memo drops later)."""
    used: list[torch.Tensor] = []
    _recording.used = used
    try:
        yield used
    finally:
        _recording.used = None
