"""Progress bars on stderr (tqdm) for every operation that can last more than a few seconds: one
place decides how they look and whether they show (DELTASERVE_PROGRESS=0 hides them). Shown when
stderr is not a terminal too (a log, CI, a pipe), redrawn less often there, so that a long
operation is never silent: the user sees it move, not a cursor."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")
# a child process's stderr line that its parent turns into a step of its bar (bench/worker.py)
CHILD_STEP = "\x1edeltaserve-progress"


def bar(total: float | None = None, desc: str = "", unit: str = "it", *,
        unit_scale: bool = False, leave: bool = True, delay: float = 0.0):
    """A tqdm bar on stderr (update(n), set_postfix_str(...), close(); a context manager).
    delay: shown only once the operation has lasted that many seconds (loading a small model
    prints nothing)."""
    from tqdm import tqdm

    from deltaserve.env import env

    tty = sys.stderr.isatty()
    shown = tqdm(total=total, desc=f"deltaserve: {desc}" if desc else "deltaserve", unit=unit,
                 unit_scale=unit_scale, leave=leave, file=sys.stderr, disable=not env().progress,
                 mininterval=0.2 if tty else 1.0, dynamic_ncols=tty, ascii=not tty, delay=delay)
    if not shown.disable:
        threading.Thread(target=_keep_alive, args=(shown, 1.0 if tty else KEEPALIVE_S),
                         daemon=True, name="deltaserve-progress").start()
    return shown


KEEPALIVE_S = 3.0  # the longest a bar in a log stays unredrawn: a slow step still shows its clock


def _keep_alive(shown, every: float) -> None:
    """Redraw `shown` (its elapsed time) when nothing has for `every` seconds, until it closes:
    one step that lasts a minute (a first request, a model's load) is not a minute of silence."""
    while True:
        time.sleep(every / 4)
        with shown.get_lock():
            if shown.disable:
                return
            now = time.time()
            if now - shown.start_t >= shown.delay and now - shown.last_print_t >= every:
                shown.display()
                shown.last_print_t = now


def track(items: Iterable[T], desc: str, total: int | None = None, unit: str = "it") -> Iterator[T]:
    """Iterate `items` with a bar that advances one per item."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with bar(total, desc, unit) as b:
        for item in items:
            yield item
            b.update(1)
