"""The CPU kernels on ARM: cross-built for aarch64 (NEON, and the scalar loops with DS_NO_NEON) and
run under qemu-user against the torch references, on fresh random inputs with odd row counts.

Needs Debian's gcc-aarch64-linux-gnu and qemu-user (`apt-get install gcc-aarch64-linux-gnu
qemu-user`); skipped with that reason where they are missing. Inputs and outputs cross as files
(tests/ops/arm/parity_main.c)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from deltaserve.ops.native import _SOURCES
from deltaserve.ops.qgemv import qgemv_act_ref, qgemv_ref
from deltaserve.quant.ggml_blocks import BLOCKS, dequantize_blocks
from deltaserve.quant.schemes import FORMATS, Scheme, quantize
from tests.ops.test_blocks import blocks_of

CC, QEMU = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
SYSROOT = Path("/usr/aarch64-linux-gnu")
pytestmark = pytest.mark.skipif(
    CC is None or QEMU is None or not SYSROOT.is_dir(),
    reason="needs gcc-aarch64-linux-gnu and qemu-user (Debian packages)")
MAIN = Path(__file__).parent / "arm" / "parity_main.c"
BUILDS = {"neon": ["-march=armv8-a"], "scalar": ["-march=armv8-a", "-DDS_NO_NEON"],
          "sdot": ["-march=armv8.2-a+dotprod"]}  # + the int8-activation kernel (gemv_q8_sdot.c)


@pytest.fixture(scope="module")
def programs(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("arm")
    built = {}
    for name, flags in BUILDS.items():
        exe = out / f"parity-{name}"
        run = subprocess.run([CC, "-O2", "-fopenmp", *flags, *map(str, _SOURCES), str(MAIN),
                              "-o", str(exe), "-lm"], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-3000:]
        built[name] = exe
    return built


def _run(exe: Path, *args) -> str:
    run = subprocess.run([QEMU, "-L", str(SYSROOT), str(exe), *map(str, args)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


def _kernel(exe: Path, tmp: Path, op: str, n: int, k: int, g: int, kind: int, **arrays) -> torch.Tensor:
    for name, t in arrays.items():
        (tmp / f"{name}.bin").write_bytes(t.contiguous().numpy().tobytes())
    _run(exe, op, n, k, g, kind, tmp)
    return torch.from_numpy(np.fromfile(tmp / "y.bin", dtype=np.float32).copy())


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("build", list(BUILDS))
def test_each_build_reports_its_vector_path(programs, build) -> None:
    assert int(_run(programs[build], "isa")) == (0 if build == "scalar" else 8)


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4", "q1"])
def test_gemv_matches_the_reference(programs, build, fmt, tmp_path) -> None:
    n, k = 37, 384
    torch.manual_seed(n + len(fmt))
    w, x = torch.randn(n, k) * 0.05, torch.randn(k)
    if fmt == "bf16":
        wb = w.bfloat16()
        y = _kernel(programs[build], tmp_path, "bf16", n, k, 0, 0, w=wb.view(torch.int16), x=x)
        want = x.double() @ wb.double().T
    else:
        scheme = FORMATS[fmt]
        p = quantize(w, scheme)
        op = {"int8": "q8", "int4": "a4", "q1": "q1"}[fmt]
        arrays = {"w": p["weight"], "s": p["scales"].float(), "x": x}
        if "biases" in p:
            arrays["b"] = p["biases"].float()
        y = _kernel(programs[build], tmp_path, op, n, k, scheme.group_size, 0, **arrays)
        want = qgemv_ref(x[None], p, scheme)[0]
    assert rel(y, want) <= 1e-5


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("kind", list(BLOCKS))
def test_block_gemv_matches_the_reference(programs, build, kind, tmp_path) -> None:
    type_id, qk = BLOCKS[kind][0], BLOCKS[kind][1]
    n, k = 19, 2 * 256 if qk == 256 else 5 * 32
    w = blocks_of(kind, n, k, seed=type_id)
    x = torch.randn(k, generator=torch.Generator().manual_seed(type_id))
    y = _kernel(programs[build], tmp_path, "blocks", n, k, 0, type_id, w=w, x=x)
    assert rel(y, x.double() @ dequantize_blocks(w, kind).double().T) <= 1e-5


@pytest.mark.parametrize("group", [64, 32])  # our int8 format; GGUF Q8_0 (two groups per 64)
def test_sdot_int8_activation_gemv_matches_its_spec(programs, group, tmp_path) -> None:
    """int8 on int8 activations (SDOT) against qgemv_act_ref, a zero group of x among them, and
    the multi-row form giving each row the GEMV's bits."""
    n, k = 45, 512
    torch.manual_seed(group)
    scheme = Scheme("int8", 8, group)
    p = quantize(torch.randn(n, k) * 0.05, scheme)
    xs = torch.randn(3, k)
    xs[0, :group] = 0.0
    arrays = {"w": p["weight"], "s": p["scales"].float()}
    rows = [_kernel(programs["sdot"], tmp_path, "q8a", n, k, group, 0, x=x, **arrays) for x in xs]
    for x, y in zip(xs, rows, strict=True):
        assert rel(y, qgemv_act_ref(x[None], p, scheme)[0]) <= 1e-6
    many = _kernel(programs["sdot"], tmp_path, "q8am", n, k, group, 3, x=xs, **arrays)
    assert torch.equal(many.view(3, n), torch.stack(rows))


def test_builds_without_sdot_have_no_int8_activation_kernel(programs, tmp_path) -> None:
    (tmp_path / "x.bin").write_bytes(b"")
    run = subprocess.run([QEMU, "-L", str(SYSROOT), str(programs["neon"]), "q8a", "1", "64", "64", "0",
                          str(tmp_path)], capture_output=True)
    assert run.returncode == 4
