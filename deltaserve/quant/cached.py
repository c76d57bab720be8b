"""Quantize-on-load: `serve --quant int8` converts the float checkpoint once into the cache folder
and loads that copy, so the second start costs nothing and runs the same bytes as
`deltaserve quantize` would have written."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from deltaserve.env import env

_DONE = ".complete"  # written last: a folder without it is a crashed conversion, redone


# per format: a changed encoder gets a fresh copy (int4 2: the least-squares search, affine_fit)
ENCODER_VERSIONS = {"int4": 2}


def _fingerprint(model_dir: Path, fmt: str) -> str:
    """Folder, format, encoder version and every weight file's name, size and mtime: a changed
    checkpoint (or encoder) gets a fresh copy instead of a stale one."""
    key = f"{model_dir.resolve()}|{fmt}"
    if fmt in ENCODER_VERSIONS:  # (formats whose encoder never changed keep their old copies)
        key += f"|{ENCODER_VERSIONS[fmt]}"
    h = hashlib.sha256(key.encode())
    for f in sorted(model_dir.glob("*.safetensors")):
        st = f.stat()
        h.update(f"|{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def quantized_copy(model_dir: Path, fmt: str, log=print) -> Path:
    from deltaserve.quant.convert import quantize_checkpoint

    root = env().cache_dir / "quantized"
    out = root / f"{model_dir.name}-{fmt}-{_fingerprint(model_dir, fmt)}"
    if (out / _DONE).is_file():
        return out
    tmp = root / f".{out.name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    log(f"quantizing {model_dir} to {fmt} once, into {out}")
    quantize_checkpoint(model_dir, fmt, tmp)
    (tmp / _DONE).write_text("")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
