"""Checkpoint fingerprints.

checkpoint_fingerprint: config.json and every safetensors header (names, shapes, dtypes, offsets)
and file size; cheap (no tensor data read), it names a checkpoint in run records.
model_fingerprint: that, plus the first MiB of each weight file's data, the dtypes and the snapshot
format version: for state that must only meet the weights it was computed with (prefix snapshots
exported to disk).
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

SNAPSHOT_FORMAT_VERSION = 1
_DATA_SAMPLE = 1 << 20


def checkpoint_fingerprint(model_dir: Path) -> str:
    h = hashlib.sha256((Path(model_dir) / "config.json").read_bytes())
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with open(f, "rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
            h.update(fh.read(min(header_len, 100_000_000)))
        h.update(str(f.stat().st_size).encode())
    return h.hexdigest()[:16]


def model_fingerprint(model_dir: Path, dtypes: str) -> str:
    """dtypes: weight, activation and KV dtypes, e.g. 'torch.bfloat16/torch.float32/None'."""
    h = hashlib.sha256(f"v{SNAPSHOT_FORMAT_VERSION}|{dtypes}|".encode())
    h.update(checkpoint_fingerprint(model_dir).encode())
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with path.open("rb") as f:
            header_len = struct.unpack("<Q", f.read(8))[0]
            f.seek(8 + header_len)
            h.update(f.read(_DATA_SAMPLE))
    return h.hexdigest()[:32]
