"""Huge-page advice: applied to large CPU tensors only, and loading stays bit-identical."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltaserve.checkpoint.loader import load_text_model
from deltaserve.checkpoint.memory import HUGE_PAGE_BYTES, advise_huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages"
)
def test_only_large_cpu_tensors_are_advised() -> None:
    big = torch.empty(8 * HUGE_PAGE_BYTES, dtype=torch.uint8)
    small = torch.empty(1024, dtype=torch.uint8)
    assert advise_huge_pages([big, small]) == 1


def test_advice_does_not_change_the_weights(tiny_dir, monkeypatch) -> None:
    from deltaserve.env import env

    models = []
    for flag in ("1", "0"):
        monkeypatch.setenv("DELTASERVE_HUGE_PAGES", flag)
        env.cache_clear()
        models.append(load_text_model(tiny_dir, "bfloat16")[0])
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b)
