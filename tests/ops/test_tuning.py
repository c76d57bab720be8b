"""ops/tuning: every measured table is data with its provenance, and the kernels read it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from deltaserve.ops import tuning

BENCHMARKS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks"
NAMES = sorted(p.stem for p in tuning.HERE.glob("*.json"))


@pytest.mark.parametrize("name", NAMES)
def test_every_row_names_its_record_and_commit(name) -> None:
    doc = tuning.load(name)
    assert doc["what"] and doc["command"] and doc["device"] and doc["rows"]
    for row in doc["rows"]:
        assert len(row["key"]) == len(doc["key"]), row
        assert all(v is None or isinstance(v, int) for v in row["key"]), row
        assert re.fullmatch(r"[0-9a-f]{7}", row["commit"]), row
        assert (BENCHMARKS / row["record"]).is_file(), f"{name}: {row['record']} is not a record"


def test_the_kernels_read_the_tables() -> None:
    from deltaserve.ops import qgemv, triton_gemv, triton_qgemv

    assert qgemv._Q8_WINNERS == tuning.table("cpu-qgemv-int8")
    assert triton_gemv.TUNED == tuning.table("h200-triton-gemv")
    assert triton_qgemv.TUNED_PDL == tuning.table("h200-triton-qgemv-pdl")
    # an open bound takes any width; first match wins, as the table's order says
    assert triton_qgemv.config_for(8, 248320, 1024) == (16, 512, 1, 1, 1)
    assert triton_qgemv.config_for(4, 248320, 1024, triton_qgemv.TUNED_ARGMAX) == (32, 512, 2, 1, 4)
    assert triton_gemv.config_for(5120, 1024) == (4, 512, 4, 1, 1)
    assert triton_gemv.config_for(5000, 1024) is None  # no entry: cuBLAS stays
