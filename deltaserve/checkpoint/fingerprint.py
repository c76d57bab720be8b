"""A model fingerprint for state that must only meet the weights it was computed with (prefix
snapshots exported to disk): config, every weight file's size and safetensors header, and the first
MiB of its data, hashed with the activation dtype and the snapshot format version."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

SNAPSHOT_FORMAT_VERSION = 1
_DATA_SAMPLE = 1 << 20


def model_fingerprint(model_dir: Path, dtypes: str) -> str:
    """dtypes: weight and activation dtypes, e.g. 'torch.bfloat16/torch.float32'."""
    h = hashlib.sha256(f"v{SNAPSHOT_FORMAT_VERSION}|{dtypes}|".encode())
    h.update((Path(model_dir) / "config.json").read_bytes())
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with path.open("rb") as f:
            head = f.read(8)
            header_len = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            h.update(path.name.encode() + struct.pack("<Q", path.stat().st_size) + head)
            h.update(f.read(min(header_len, 1 << 27)))
            h.update(f.read(_DATA_SAMPLE))
    return h.hexdigest()[:32]
