"""The native kernels' cache (ops/native_cache.py, through ops/native.build): a build is installed
owner-only with the SHA-256 of its bytes, and a cached library is loaded only if nobody else could
have written it; anything else is rebuilt. The checks here read the files themselves, so they
hold for any implementation (the one before this cache loaded whatever file it found)."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deltaserve.ops.native import _compiler, build

LIB, HASH = "libdeltaserve_cpu.so", "libdeltaserve_cpu.so.sha256"
REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(_compiler() is None, reason="no C compiler")


def key_dirs(cache: Path) -> list[Path]:
    """The build folders under cache (not locks, staging folders or displaced builds)."""
    return [p for p in (cache / "native").iterdir() if not p.name.startswith(".")]


def assert_installed(key_dir: Path) -> None:
    """A real owner-only folder whose library matches the hash recorded beside it."""
    assert not key_dir.is_symlink() and key_dir.is_dir()
    for path in (key_dir, key_dir / LIB, key_dir / HASH):
        st = os.lstat(path)
        assert st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH), path
    assert stat.S_IMODE(os.lstat(key_dir).st_mode) == 0o700
    digest = hashlib.sha256((key_dir / LIB).read_bytes()).hexdigest()
    assert (key_dir / HASH).read_text().split()[0] == digest


@pytest.fixture(scope="module")
def seed(tmp_path_factory) -> Path:
    """One build, copied into each test's cache (a build takes seconds on 2 busy cores)."""
    cache = tmp_path_factory.mktemp("seed")
    assert build("native", cache) is not None
    return key_dirs(cache)[0]


@pytest.fixture
def cached(seed, tmp_path) -> Path:
    """A cache folder holding the seed build; returns the build's folder."""
    (tmp_path / "native").mkdir(mode=0o700)
    key_dir = tmp_path / "native" / seed.name
    shutil.copytree(seed, key_dir)  # modes kept
    return key_dir


def assert_rebuilt(key_dir: Path, capsys, why: str) -> None:
    """build() over a cache whose content was made untrustworthy: it says why and rebuilds."""
    lib = build("native", key_dir.parents[1])
    assert lib is not None and lib.ds_simd_lanes() in (0, 16)
    err = capsys.readouterr().err
    assert "not loading the cached CPU kernels" in err and why in err, err
    assert key_dirs(key_dir.parents[1]) == [key_dir]
    assert_installed(key_dir)


def test_a_build_is_installed_owner_only_with_its_hash(tmp_path) -> None:
    assert build("native", tmp_path) is not None
    (key_dir,) = key_dirs(tmp_path)
    assert_installed(key_dir)
    assert stat.S_IMODE(os.lstat(tmp_path / "native").st_mode) == 0o700


def test_a_valid_build_is_loaded_not_rebuilt(cached, capsys) -> None:
    inode = os.stat(cached / LIB).st_ino
    assert build("native", cached.parents[1]) is not None
    assert os.stat(cached / LIB).st_ino == inode and not capsys.readouterr().err


def test_a_tampered_library_is_not_loaded_but_rebuilt(cached, capsys) -> None:
    lib = cached / LIB
    data = bytearray(lib.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte of the code, the file's owner and modes kept
    lib.write_bytes(bytes(data))
    assert_rebuilt(cached, capsys, "does not match the hash")
    assert lib.read_bytes() != bytes(data)


@pytest.mark.parametrize("what", ["folder", "library", "hash file"])
def test_a_group_or_world_writable_build_is_rebuilt(cached, capsys, what) -> None:
    path = {"folder": cached, "library": cached / LIB, "hash file": cached / HASH}[what]
    os.chmod(path, stat.S_IMODE(os.lstat(path).st_mode) | stat.S_IWGRP | stat.S_IWOTH)
    assert_rebuilt(cached, capsys, "group- or world-writable")


def test_a_symlinked_build_folder_is_rebuilt(cached, tmp_path, capsys) -> None:
    """Even one pointing at a valid build: whoever wrote the link chose what loads."""
    elsewhere = tmp_path / "elsewhere"
    cached.rename(elsewhere)
    cached.symlink_to(elsewhere, target_is_directory=True)
    assert_rebuilt(cached, capsys, "is a symlink")
    assert_installed(elsewhere)  # the link is replaced; what it pointed at is left alone


def test_a_library_owned_by_another_user_is_rebuilt(cached, capsys, monkeypatch) -> None:
    """Another uid, simulated: lstat reports one for the cached library's inode (not for the
    rebuilt one, a new file)."""
    victim, real_lstat = os.stat(cached / LIB).st_ino, os.lstat

    def lstat(path, *args, **kwargs):
        st = real_lstat(path, *args, **kwargs)
        if os.fspath(path) == str(cached / LIB) and st.st_ino == victim:
            fields = list(st)
            fields[stat.ST_UID] = st.st_uid + 1
            return os.stat_result(fields)
        return st

    monkeypatch.setattr(os, "lstat", lstat)
    assert_rebuilt(cached, capsys, f"owned by uid {os.getuid() + 1}")
    assert os.stat(cached / LIB).st_ino != victim


def test_an_old_group_writable_native_folder_is_closed_to_others(tmp_path) -> None:
    """native/ made under umask 002 by an older tree: ours, so no longer group-writable, and
    builds still cache there."""
    (tmp_path / "native").mkdir()
    os.chmod(tmp_path / "native", 0o775)
    assert build("native", tmp_path) is not None
    assert stat.S_IMODE(os.lstat(tmp_path / "native").st_mode) == 0o755
    (key_dir,) = key_dirs(tmp_path)
    assert_installed(key_dir)


def test_a_native_folder_of_another_user_gets_a_private_build(
    tmp_path, capsys, monkeypatch
) -> None:
    """Whoever owns native/ could swap a build between our check and the load: nothing there is
    loaded or written; the build goes to a private folder, removed once loaded."""
    native_dir, real_stat = tmp_path / "native", os.stat
    native_dir.mkdir(mode=0o700)

    def fake_stat(path, *args, **kwargs):
        st = real_stat(path, *args, **kwargs)
        if os.fspath(path) == str(native_dir):
            fields = list(st)
            fields[stat.ST_UID] = st.st_uid + 1
            return os.stat_result(fields)
        return st

    monkeypatch.setattr(os, "stat", fake_stat)
    lib = build("native", tmp_path)
    assert lib is not None and lib.ds_simd_lanes() in (0, 16)
    assert "owned by uid" in capsys.readouterr().err
    assert not key_dirs(tmp_path) and not list(native_dir.iterdir())
    assert not Path(lib._name).is_relative_to(tmp_path) and not Path(lib._name).exists()


CHILD = """
import os, sys, time
from pathlib import Path
from deltaserve.ops.native import build
cache, go = Path(sys.argv[1]), Path(sys.argv[2])
(go.parent / f"ready.{os.getpid()}").touch()
while not go.exists():
    time.sleep(0.005)
lib = build("native", cache)
print("loaded" if lib is not None and lib.ds_simd_lanes() in (0, 16) else "failed")
"""


def test_two_processes_building_at_once_both_load_and_leave_one_build(cached, tmp_path) -> None:
    """Tensor-parallel ranks start together. The cached build is tampered with, so both must act
    on it; they start on one signal once both have imported deltaserve."""
    lib = cached / LIB
    lib.write_bytes(lib.read_bytes()[:-1] + b"\0")
    signals = tmp_path / "signals"
    signals.mkdir()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(tmp_path), str(signals / "go")],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    deadline = time.monotonic() + 120
    while len(list(signals.glob("ready.*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    (signals / "go").touch()
    outs = [p.communicate(timeout=300) for p in procs]
    assert [out.strip() for out, _ in outs] == ["loaded", "loaded"], outs
    assert key_dirs(tmp_path) == [cached]
    assert_installed(cached)
    # no staging folder or displaced build left behind (the lock file may stay)
    assert {p.name for p in (tmp_path / "native").iterdir()} <= {
        cached.name,
        f".{cached.name}.lock",
    }
