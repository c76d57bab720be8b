"""The GPU benchmark's host-side parts: nvidia-smi parsing, temperature policy, roofline math,
bytes per decoded token (the GPU runs themselves happen on the device machine)."""

from __future__ import annotations

import subprocess

import pytest

from deltaserve.bench.gpu import (
    Thermals,
    decode_bytes_per_token,
    gpu_state,
    roofline_pct,
    settle,
)
from deltaserve.errors import DeltaserveError


def fake_smi(stdout: str, returncode: int = 0):
    def run(cmd, **kwargs):
        assert cmd[0] == "nvidia-smi" and "--format=csv,noheader,nounits" in cmd
        return subprocess.CompletedProcess(cmd, returncode, stdout=stdout, stderr="")
    return run


def test_gpu_state_parses_and_skips_unavailable_fields() -> None:
    assert gpu_state(fake_smi("45, 1980, 2619, 120.5\n")) == {
        "temp_c": 45.0, "sm_mhz": 1980.0, "mem_mhz": 2619.0, "power_w": 120.5}
    assert gpu_state(fake_smi("45, 1980, 2619, [N/A]\n")) == {
        "temp_c": 45.0, "sm_mhz": 1980.0, "mem_mhz": 2619.0}
    assert gpu_state(fake_smi("", returncode=9)) == {}


def test_settle_waits_for_the_start_temperature_and_aborts_above_the_stop() -> None:
    temps = iter([70.0, 66.0, 58.0])
    slept = []
    state = settle(Thermals(60.0, 85.0, 120.0), read=lambda: {"temp_c": next(temps)},
                   sleep=slept.append)
    assert state["temp_c"] == 58.0 and state["waited_s"] == 10.0 and slept == [5.0, 5.0]
    with pytest.raises(DeltaserveError, match="above the stop temperature"):
        settle(Thermals(60.0, 85.0, 10.0), read=lambda: {"temp_c": 90.0}, sleep=lambda s: None)
    gave_up = settle(Thermals(60.0, 85.0, 10.0), read=lambda: {"temp_c": 70.0},
                     sleep=lambda s: None)
    assert gave_up["waited_s"] == 10.0  # measured anyway, the wait is recorded


def test_roofline_is_bytes_per_token_times_rate_over_bandwidth() -> None:
    # 1 GB per token at 2,000 tok/s = 2 TB/s of a 4 TB/s copy bandwidth
    assert roofline_pct(2000.0, 10**9, 4000.0) == pytest.approx(50.0)


def test_decode_bytes_count_every_matrix_once(tiny_llm) -> None:
    model = tiny_llm.model
    want = sum(p.numel() * p.element_size() for p in model.parameters() if p.dim() == 2)
    assert decode_bytes_per_token(model) == want > 0
