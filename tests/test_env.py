"""The environment knobs (deltaserve/env.py): integer choices read as given or rejected by name."""

from __future__ import annotations

import pytest

from deltaserve.env import Env


@pytest.mark.parametrize(("value", "expected"), [(None, 0), ("", 0), ("1", 1), (" 2 ", 2)])
def test_gemv_prefetch_reads_its_choices(monkeypatch, value, expected) -> None:
    if value is None:
        monkeypatch.delenv("DELTASERVE_GEMV_PREFETCH", raising=False)
    else:
        monkeypatch.setenv("DELTASERVE_GEMV_PREFETCH", value)
    assert Env.read().gemv_prefetch == expected


@pytest.mark.parametrize("value", ["3", "yes", "-1"])
def test_gemv_prefetch_rejects_other_values_by_name(monkeypatch, value) -> None:
    monkeypatch.setenv("DELTASERVE_GEMV_PREFETCH", value)
    with pytest.raises(ValueError, match="DELTASERVE_GEMV_PREFETCH"):
        Env.read()
