"""Prefix snapshots to and from disk: one safetensors file holding every snapshot's GDN states and
the KV blocks they reference (each block once), with the model fingerprint in its metadata.

An import checks the fingerprint, the format version, shapes and dtypes, and that the KV pool has
room, before it changes anything: a refused file leaves the cache exactly as it was.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from deltaserve.cache.prefix import PrefixCache, Snapshot
from deltaserve.checkpoint.fingerprint import SNAPSHOT_FORMAT_VERSION
from deltaserve.errors import CheckpointError


def export_snapshots(cache: PrefixCache, path: Path) -> int:
    """Write every snapshot of `cache` to `path`; returns how many."""
    tensors: dict[str, torch.Tensor] = {}
    block_ids = sorted({b for s in cache.entries.values() for b in s.blocks})
    where = {b: i for i, b in enumerate(block_ids)}
    for layer in range(len(cache.kv.k)):
        if cache.kv.block_layout(layer) is not None and block_ids:
            tensors[f"kv.{layer}.k"], tensors[f"kv.{layer}.v"] = \
                cache.kv.read_blocks(layer, block_ids)
    entries = []
    for n, snap in enumerate(cache.entries.values()):
        for layer, state in enumerate(snap.states):
            if state is not None:
                tensors[f"s{n}.{layer}.conv"] = state[0].cpu().contiguous()
                tensors[f"s{n}.{layer}.state"] = state[1].cpu().contiguous()
        entries.append({"key": snap.key.hex(), "length": snap.length,
                        "blocks": [where[b] for b in snap.blocks]})
    meta = {"fingerprint": cache.fingerprint, "version": str(SNAPSHOT_FORMAT_VERSION),
            "granularity": str(cache.granularity), "block_len": str(cache.kv.block_len),
            "entries": json.dumps(entries)}
    save_file(tensors, str(path), metadata=meta)
    return len(entries)


def import_snapshots(cache: PrefixCache, path: Path) -> int:
    """Add the snapshots in `path` to `cache`; returns how many. Refuses (CheckpointError) a file
    from another model, dtype, format, grid or block size, or one that does not fit."""
    path = Path(path)
    try:
        tensors = load_file(str(path))
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
    except (OSError, SafetensorError) as exc:
        raise CheckpointError(f"cannot read prefix snapshots from {path}: {exc}") from exc
    expect = {"fingerprint": cache.fingerprint, "version": str(SNAPSHOT_FORMAT_VERSION),
              "granularity": str(cache.granularity), "block_len": str(cache.kv.block_len)}
    for name, want in expect.items():
        if meta.get(name) != want:
            raise CheckpointError(
                f"{path}: prefix snapshots were made with {name}={meta.get(name)!r}, this engine "
                f"has {want!r} (another model, dtype or cache layout): refused, nothing changed"
            )
    entries = json.loads(meta["entries"])
    num_blocks = _check_shapes(cache, tensors, entries, path)
    blocks = cache.kv.allocate(num_blocks) if num_blocks else []
    if blocks is None:
        raise CheckpointError(f"{path}: {num_blocks} KV blocks needed, {cache.kv.num_free} free")
    for layer in range(len(cache.kv.k)):
        if cache.kv.block_layout(layer) is not None and blocks:
            cache.kv.write_blocks(layer, blocks, tensors[f"kv.{layer}.k"],
                                  tensors[f"kv.{layer}.v"])
    device = cache.kv.device
    for n, e in enumerate(entries):
        states = [_state(tensors, n, layer, device) for layer in range(len(cache.kv.k))]
        snap_blocks = [blocks[i] for i in e["blocks"]]
        _insert(cache, bytes.fromhex(e["key"]), e["length"], states, snap_blocks)
    cache.kv.decref(blocks)  # the snapshots now hold their own references
    return len(entries)


def _state(tensors, n: int, layer: int, device):
    conv = tensors.get(f"s{n}.{layer}.conv")
    return None if conv is None else (conv.to(device), tensors[f"s{n}.{layer}.state"].to(device))


def _insert(cache: PrefixCache, key: bytes, length: int, states, blocks: list[int]) -> None:
    if key in cache.entries:
        return
    nbytes = sum(c.numel() * c.element_size() + s.numel() * s.element_size()
                 for st in states if st is not None for c, s in [st])
    cache.kv.incref(blocks)
    cache.entries[key] = Snapshot(key, length, states, blocks, nbytes)
    cache.nbytes += nbytes
    while cache.nbytes > cache.budget_bytes:
        cache.evict_one()


def _check_shapes(cache: PrefixCache, tensors: dict, entries: list, path: Path) -> int:
    """Every tensor the entries need, with this engine's shapes and dtypes; returns #blocks."""
    num_blocks = 0
    for layer in range(len(cache.kv.k)):
        layout = cache.kv.block_layout(layer)
        if layout is None or f"kv.{layer}.k" not in tensors:
            continue
        dtype, shape = layout
        for name in (f"kv.{layer}.k", f"kv.{layer}.v"):
            t = tensors[name]
            if t.dtype != dtype or tuple(t.shape[1:]) != shape:
                raise CheckpointError(f"{path}: {name} is {t.dtype} {tuple(t.shape)}, this engine "
                                      f"keeps {dtype} blocks of {shape}: refused")
        num_blocks = tensors[f"kv.{layer}.k"].shape[0]
    for n, e in enumerate(entries):
        if any(not 0 <= i < num_blocks for i in e["blocks"]):
            raise CheckpointError(f"{path}: snapshot {n} names a KV block the file does not hold")
        for layer in range(len(cache.kv.k)):
            if cache.kv.k[layer] is None and f"s{n}.{layer}.conv" not in tensors:
                raise CheckpointError(f"{path}: snapshot {n} lacks layer {layer}'s GDN state")
    return num_blocks
