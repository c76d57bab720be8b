"""GPU backend selection (no GPU needed: the device queries are stubbed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from deltaserve.env import env
from deltaserve.errors import ConfigError
from deltaserve.ops import backend


@pytest.fixture
def gpu(monkeypatch):
    """A fake CUDA GPU of a chosen compute capability, triton importable or not."""
    state = {"capability": (9, 0), "triton": True}
    monkeypatch.setattr(backend.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(backend, "_capability", lambda: state["capability"])
    monkeypatch.setattr(backend, "_triton_importable", lambda: state["triton"])
    backend._resolve.cache_clear()
    yield state
    backend._resolve.cache_clear()


def set_env(monkeypatch, name: str, value: str | None) -> None:
    """name=value in the environment (None: unset), re-read by env()."""
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)
    env.cache_clear()


def choose(monkeypatch, value: str | None) -> str:
    set_env(monkeypatch, "DELTASERVE_GPU_BACKEND", value)
    backend._resolve.cache_clear()
    return backend.gpu_backend()


def test_auto_picks_triton_from_sm80_and_portable_below(gpu, monkeypatch) -> None:
    assert choose(monkeypatch, None) == "triton"
    gpu["capability"] = (7, 5)
    assert choose(monkeypatch, "auto") == "portable"
    gpu["capability"], gpu["triton"] = (9, 0), False
    assert choose(monkeypatch, "auto") == "portable"


def test_portable_can_be_forced_on_a_new_gpu(gpu, monkeypatch) -> None:
    assert choose(monkeypatch, "portable") == "portable"
    assert not backend.triton_enabled()


def test_triton_on_an_old_gpu_is_a_clear_error(gpu, monkeypatch) -> None:
    gpu["capability"] = (6, 1)
    with pytest.raises(ConfigError, match="sm_61.*portable"):
        choose(monkeypatch, "triton")


def test_unknown_backend_is_a_clear_error(gpu, monkeypatch) -> None:
    with pytest.raises(ConfigError, match="auto, triton, portable"):
        choose(monkeypatch, "vulkan")


def test_without_cuda_everything_is_portable(monkeypatch) -> None:
    monkeypatch.setattr(backend.torch.cuda, "is_available", lambda: False)
    assert choose(monkeypatch, "triton") == "portable"
    backend._resolve.cache_clear()


@pytest.mark.parametrize(("capability", "cuda", "hip", "flag", "expected"), [
    ((9, 0), "13.0", None, None, True),  # Hopper, default on
    ((9, 0), "13.0", None, "0", False),  # DELTASERVE_PDL=0
    ((8, 9), "13.0", None, None, False),  # no griddepcontrol before sm_90
    ((9, 0), "12.2", None, None, False),  # graph capture keeps PDL edges from CUDA 12.3
    ((9, 4), None, "6.4", None, False),  # ROCm reports a capability too
])
def test_pdl_only_where_the_gpu_and_toolkit_have_it(monkeypatch, capability, cuda, hip, flag,
                                                    expected) -> None:
    # a Triton 3.6 with grid-dependency control, whether or not this install has Triton
    monkeypatch.setattr(backend, "triton", SimpleNamespace(__version__="3.6.0"))
    monkeypatch.setattr(backend, "HAS_GDC", True)
    monkeypatch.setattr(backend.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(backend, "_capability", lambda: capability)
    monkeypatch.setattr(backend.torch.version, "cuda", cuda)
    monkeypatch.setattr(backend.torch.version, "hip", hip)
    set_env(monkeypatch, "DELTASERVE_PDL", flag)
    backend.pdl_supported.cache_clear()
    try:
        assert backend.pdl_enabled() is expected
        assert backend.pdl_args() == ({"PDL": True, "launch_pdl": True} if expected
                                      else {"PDL": False})
    finally:
        backend.pdl_supported.cache_clear()
        env.cache_clear()
