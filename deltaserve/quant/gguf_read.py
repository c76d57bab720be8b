"""A GGUF file's metadata and tensor table, read directly (the layout: formats.md section 6).

The `gguf` package's GGUFReader builds a numpy view per metadata element: on a Qwen3.5 file its
~250k vocabulary strings and ~250k merges took ~10 s (18 s on a busy 2-core VM) before anything
else happened. Here the key/value section is parsed with plain byte slicing (~0.3 s), and tensor
data stays a view of one memory map of the file. Tensor types are the gguf package's enum.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"GGUF"
# GGUF value types -> struct format of a scalar (8: string, 9: array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


@dataclass(frozen=True, slots=True)
class Tensor:
    """name; tensor_type (gguf.GGMLQuantizationType); shape in ggml order (ne0 = the row
    length first); data: F32 / F16 typed, every other type its raw bytes [rows, row bytes]."""

    name: str
    tensor_type: object
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True, slots=True)
class GGUFFile:
    meta: dict
    tensors: list[Tensor]


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.at = buf, 0

    def take(self, fmt: str):
        value = struct.unpack_from(fmt, self.buf, self.at)[0]
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        text = bytes(self.buf[self.at:self.at + n]).decode("utf-8", errors="replace")
        self.at += n
        return text

    def value(self, kind: int):
        if kind == 8:
            return self.string()
        if kind == 9:
            sub, count = self.take("<I"), self.take("<Q")
            if sub == 8:
                return [self.string() for _ in range(count)]
            if sub in _NUMPY:
                arr = np.frombuffer(self.buf, _NUMPY[sub], count, self.at)
                self.at += arr.nbytes
                return arr.tolist()
            return [self.value(sub) for _ in range(count)]
        if kind not in _SCALARS:
            raise ValueError(f"unknown metadata value type {kind}")
        return self.take(_SCALARS[kind])


def read_gguf(path: Path) -> GGUFFile:
    """Metadata and tensors of one GGUF file; ValueError (or struct.error) on a malformed or
    truncated one."""
    import gguf

    mm = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(mm))
    if bytes(mm[:4]) != MAGIC:
        raise ValueError("not a GGUF file (bad magic)")
    cur.at = 4
    version = cur.take("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
    num_tensors, num_kv = cur.take("<Q"), cur.take("<Q")
    meta = {}
    for _ in range(num_kv):
        key = cur.string()
        meta[key] = cur.value(cur.take("<I"))
    infos = []
    for _ in range(num_tensors):
        name = cur.string()
        dims = tuple(cur.take("<Q") for _ in range(cur.take("<I")))
        infos.append((name, dims, cur.take("<I"), cur.take("<Q")))
    align = int(meta.get("general.alignment", 32))
    start = -(-cur.at // align) * align
    tensors = []
    for name, dims, kind, offset in infos:
        qtype = gguf.GGMLQuantizationType(kind)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        count = int(np.prod(dims, dtype=np.int64))
        nbytes = count // block * size
        at = start + offset
        if at + nbytes > mm.shape[0]:
            raise ValueError(f"tensor '{name}' runs past the end of the file (truncated?)")
        raw = mm[at:at + nbytes]
        if qtype.name == "F32":
            data = raw.view(np.float32)
        elif qtype.name == "F16":
            data = raw.view(np.float16)
        else:
            data = raw.reshape(count // dims[0], -1)
        tensors.append(Tensor(name, qtype, dims, data))
    return GGUFFile(meta, tensors)
