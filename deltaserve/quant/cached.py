"""Conversions kept in the cache folder, done once and loaded from there after: quantize-on-load
(`serve --quant int8` converts the float checkpoint and loads that copy, so the second start costs
nothing and runs the same bytes as `deltaserve quantize` would have written), and a GGUF file given
as the model (repacked into a checkpoint folder, keyed by the file's fingerprint)."""

from __future__ import annotations

import hashlib
import shutil
import time
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
    def build(tmp: Path) -> None:
        log(f"quantizing {model_dir} to {fmt} once, into {out}")
        quantize_checkpoint(model_dir, fmt, tmp)

    _once(out, build)
    return out


def _once(out: Path, build) -> bool:
    """build(tmp) then tmp renamed to out, unless out is complete; False if it already was.
    Processes that ask at once (the ranks of `--tp 2` on a new file) take a file lock: one
    builds, the others wait for it and find out complete."""
    import fcntl

    if (out / _DONE).is_file():
        return False
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / _DONE).is_file():
            return False
        tmp = out.parent / f".{out.name}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            build(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        (tmp / _DONE).write_text("")
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return True


GGUF_IMPORTER_VERSION = 4  # a changed importer gets a fresh copy


def gguf_copy(parts: list[Path], log=print, mmproj: Path | None = None) -> Path:
    """The checkpoint folder for a GGUF file (or the parts of a split set; with MiniCPM-V's mmproj
    file: quant/gguf_mmproj), written once into the cache atomically (a crashed import leaves only
    a .partial folder, redone next time)."""
    from deltaserve.quant.gguf_import import import_gguf

    h = hashlib.sha256(f"gguf|{GGUF_IMPORTER_VERSION}".encode())
    for f in parts + ([mmproj] if mmproj is not None else []):
        st = f.stat()
        h.update(f"|{f.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    root = env().cache_dir / "gguf"
    stem = parts[0].name.removesuffix(".gguf")
    out = root / f"{stem}-{h.hexdigest()[:16]}"
    size = sum(f.stat().st_size for f in parts)
    start, report = time.perf_counter(), {}

    def build(tmp: Path) -> None:
        log(f"importing {parts[0]}{f' (+{len(parts) - 1} parts)' if len(parts) > 1 else ''} "
            f"({size / 2**30:.2f} GiB) once, into {out}")
        if mmproj is not None:
            log(f"vision tower and projector from {mmproj}")
        report.update(import_gguf(parts[0], tmp, mmproj=mmproj))

    if not _once(out, build):
        return out
    written = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    log(f"imported in {time.perf_counter() - start:.1f} s: {written / 2**30:.2f} GiB in {out}")
    log("tensor types: " + ", ".join(f"{k} ({n})" for k, n in report["types"].items()))
    return out
