"""Weight rows per block of the int8 and 4-bit int8-activation GEMVs (ops/csrc/gemv_vnni.c): 4
rows share each load of the quantized activation, or 1 row streams alone with the next row's codes
prefetched (q1, 8 code bytes per 64 weights, always shares: 12.4 vs 8.8 GB/s there).
Which is faster depends on the machine's memory system (a 2-core AMD EPYC: the Q8_0 vocabulary
head streamed 18 GB/s with 4, 38 GB/s with 1; the Xeon the 4 was tuned on preferred 4), so it is
measured once per CPU and thread count on a weight larger than the caches (~50 ms), kept in the
cache folder, and DELTASERVE_CPU_GEMV_ROWS=1|4 forces it. A row's arithmetic is the same either
way: y is bit-identical (tests/ops/test_qgemv.py)."""

from __future__ import annotations

import hashlib
import json
import time

import torch

from deltaserve.env import env

_ROWS = (4, 1)


def configure(lib) -> int:
    """Set the kernels' rows per block (0 where the library has no such kernels); returns it."""
    setter = getattr(lib, "ds_set_vnni_rows", None)
    if setter is None:
        return 0
    rows = env().cpu_gemv_rows or _cached(lib)
    setter(rows)
    return rows


def _cached(lib) -> int:
    from deltaserve.ops.native import _cpu_signature

    threads = torch.get_num_threads()
    key = hashlib.sha256(f"{_cpu_signature()}|{_cpu_model()}|{threads}".encode()).hexdigest()
    path = env().cache_dir / "native" / f"gemv-rows-{key[:16]}.json"
    try:
        return int(json.loads(path.read_text())["rows"])
    except (OSError, ValueError, KeyError):
        pass
    rows, times = measure(lib, threads)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{id(times)}.tmp")
        tmp.write_text(json.dumps({"rows": rows, "seconds": times, "threads": threads}))
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache: measured again next time
    return rows


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as lines:
            return next((ln for ln in lines if ln.startswith("model name")), "")
    except OSError:
        return ""


def measure(lib, threads: int) -> tuple[int, dict[int, float]]:
    """(the faster rows per block, {rows: best seconds}) for an int8 g64 GEMV over 128 MiB of
    codes, past any last-level cache here; 4 unless 1 is at least 5% faster."""
    n, k, g = 1 << 17, 1024, 64
    w = torch.ones(n, k, dtype=torch.int8)
    s = torch.full((n, k // g), 0.01, dtype=torch.float16)
    x, y = torch.randn(k), torch.empty(n)
    best = {r: float("inf") for r in _ROWS}
    for _ in range(3):
        for rows in _ROWS:
            lib.ds_set_vnni_rows(rows)
            start = time.perf_counter()
            lib.ds_gemv_q8_vnni(w.data_ptr(), s.data_ptr(), x.data_ptr(), y.data_ptr(), n, k, g,
                                threads, 1)
            best[rows] = min(best[rows], time.perf_counter() - start)
    return (1 if best[1] < 0.95 * best[4] else 4), best
