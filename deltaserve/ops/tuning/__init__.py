"""Measured tuning tables as data: one JSON file per table beside this module, each row with the
record in docs/benchmarks it came from and the commit measured (`record`, `commit`, `note`), the
command that measures it again (`command`) and the machine (`device`). The kernels' dispatch reads
them through table(); a new sweep's result is a new file version, not a code change.

A row's key is a tuple of ints (a null bound is open: no upper limit); its value a tuple (launch
configs) or a string (which kernel won).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

HERE = Path(__file__).parent
OPEN = 1 << 40  # a null bound in a key: larger than any dimension


@functools.cache
def load(name: str) -> dict:
    """The whole file `name`.json (header and rows)."""
    return json.loads((HERE / f"{name}.json").read_text(encoding="utf-8"))


def table(name: str) -> dict[tuple, tuple | str]:
    """key -> value of every row, in file order (lookups take the first match)."""
    rows = load(name)["rows"]
    return {tuple(OPEN if v is None else v for v in r["key"]):
            tuple(r["value"]) if isinstance(r["value"], list) else r["value"] for r in rows}
