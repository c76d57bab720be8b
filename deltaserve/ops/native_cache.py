"""The native kernels' cache folder, written and read so that no one else's file is ever loaded.

A build is installed as one owner-only folder `native/<key>/` holding the library and the SHA-256
of its bytes, moved into place by a single rename (a reader sees the old folder or the new one,
never a library without its hash). Before loading, the folder, the library and the hash file must
be owned by this user and not writable by group or others, and the library's bytes must match the
recorded hash; otherwise the caller rebuilds and replaces the folder. The parent `native/` must be
writable by us alone (made so where it is ours); where it is not, builds stay private to the
process.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import stat
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

LIB_NAME = "libdeltaserve_cpu.so"
HASH_NAME = LIB_NAME + ".sha256"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def distrust(path: Path, is_kind: Callable[[int], bool], follow: bool = False) -> str | None:
    """Why `path` must not be trusted, or None: missing, a symlink (unless `follow`), not of its
    kind (`stat.S_ISDIR` / `S_ISREG`), owned by another user, or writable by group or others (who
    could then swap its content)."""
    try:
        st = os.stat(path) if follow else os.lstat(path)
    except FileNotFoundError:
        return f"{path.name} is missing"
    except OSError as exc:
        return f"{path} cannot be examined ({exc.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symlink"
    if not is_kind(st.st_mode):
        return f"{path} is not a {'folder' if is_kind is stat.S_ISDIR else 'regular file'}"
    if st.st_uid != os.getuid():
        return f"{path} is owned by uid {st.st_uid}, not this user ({os.getuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is group- or world-writable"
    return None


def _distrust_parent(key_dir: Path) -> str | None:
    # native/ itself: whoever may write there may rename key_dir between our check and the load.
    # Followed if a symlink (a cache folder moved to another disk), as its target is what counts.
    return distrust(key_dir.parent, stat.S_ISDIR, follow=True)


def verified(key_dir: Path) -> tuple[Path | None, str | None]:
    """(the library, None) when key_dir holds a build that passes every check; (None, why) when it
    holds something that does not, or its parent folder is not ours alone; (None, None) when
    nothing is there yet."""
    why = _distrust_parent(key_dir)
    if why is not None:
        return None, why
    if not os.path.lexists(key_dir):
        return None, None
    lib, digest = key_dir / LIB_NAME, key_dir / HASH_NAME
    # the folder first: its entries are only as safe as it
    for path, is_kind in ((key_dir, stat.S_ISDIR), (lib, stat.S_ISREG), (digest, stat.S_ISREG)):
        why = distrust(path, is_kind)
        if why is not None:
            return None, why
    recorded = digest.read_bytes().split()
    if not recorded or recorded[0] != _sha256(lib).encode():
        return None, f"{lib} does not match the hash recorded when it was built"
    return lib, None


def _remove(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def locked(key_dir: Path) -> Iterator[None]:
    """Holds a lock on key_dir's build across processes (tensor-parallel ranks start together):
    the second waits, then finds the first's build, instead of compiling and replacing it while
    the first loads it. Creates the parent folder owner-only; where it is ours but writable by
    others (older trees made it 0o775 under umask 002), takes their write access away. Unlocked
    where the parent is not ours alone (its owner could hold the lock forever) or the lock file
    cannot be opened."""
    parent = key_dir.parent
    parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.stat(parent)
    if st.st_uid == os.getuid() and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        os.chmod(parent, stat.S_IMODE(st.st_mode) & ~(stat.S_IWGRP | stat.S_IWOTH))
    if _distrust_parent(key_dir) is not None:
        yield
        return
    try:
        fd = os.open(
            parent / f".{key_dir.name}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600
        )
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def install(key_dir: Path, compile_to: Callable[[Path], bool]) -> Path | None:
    """Compile into a fresh owner-only folder beside key_dir (`compile_to(path)` writes the library,
    False on failure), record its hash, and move the folder into place, replacing whatever was
    there. The library's path; None when compiling failed. Where the parent folder is not ours
    alone, a private copy in the system's temporary folder, not installed (the caller loads it,
    then removes its folder)."""
    shared = _distrust_parent(key_dir) is None
    # 0o700; beside key_dir so that the move is one rename
    staging = Path(
        tempfile.mkdtemp(prefix=f".{key_dir.name}.", dir=key_dir.parent if shared else None)
    )
    lib = staging / LIB_NAME
    if not compile_to(lib):
        shutil.rmtree(staging, ignore_errors=True)
        return None
    os.chmod(lib, 0o700)
    if not shared:
        return lib
    fd = os.open(staging / HASH_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(f"{_sha256(lib)}  {LIB_NAME}\n")
    displaced = key_dir.with_name(f".{key_dir.name}.{uuid.uuid4().hex}.old")
    try:
        os.rename(key_dir, displaced)  # an untrusted or stale build: set aside, then removed
    except OSError:
        displaced = None  # nothing there, or not ours to move (then the rename below fails)
    try:
        os.rename(staging, key_dir)
    except OSError:
        # another process installed its build meanwhile: use it if it passes, else our own copy
        # (the caller loads it from the staging folder, then removes that folder)
        if verified(key_dir)[0] is not None:
            shutil.rmtree(staging, ignore_errors=True)
            return key_dir / LIB_NAME
        return lib
    finally:
        if displaced is not None:
            _remove(displaced)
    return key_dir / LIB_NAME
