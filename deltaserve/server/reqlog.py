"""One log line per request (vLLM's habit): its id, status, prompt and completion tokens, time to
first token and total time; `serve --disable-log-requests` silences them, `--log-level` sets the
server's level."""

from __future__ import annotations

import logging
import time

LOG = logging.getLogger("deltaserve.server.requests")


def request_done(rid: str, status: int, n_prompt: int, n_out: int, started: float,
                 first_at: float | None) -> None:
    """started / first_at: time.monotonic() when the request was submitted / its first event."""
    if not LOG.isEnabledFor(logging.INFO):
        return
    now = time.monotonic()
    ttft = f"{first_at - started:.3f} s" if first_at is not None else "-"
    LOG.info("%s: %d, %d prompt + %d completion tokens, TTFT %s, total %.3f s", rid, status,
             n_prompt, n_out, ttft, now - started)


def request_refused(method: str, path: str, status: int, message: str) -> None:
    LOG.info("%s %s: %d %s", method, path, status, message[:200])
