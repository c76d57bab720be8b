"""Signals for `deltaserve serve`: the first SIGINT / SIGTERM drains, a second one exits now."""

from __future__ import annotations

import os
import signal
import sys
import threading

import uvicorn


class DrainingServer(uvicorn.Server):
    """uvicorn's server with our signals. The first stops accepting connections and gives
    in-flight requests drain_s seconds, then ends what still runs with an error (host.cut: an
    error event and [DONE] on streams, a 503 otherwise). A second, SIGINT or SIGTERM, exits at once
    without interpreter teardown, which with the engine thread inside torch can abort
    ('terminate called without an active exception')."""

    def __init__(self, config: uvicorn.Config, host, drain_s: float) -> None:
        super().__init__(config)
        self.host, self.drain_s = host, drain_s

    def handle_exit(self, sig: int, frame) -> None:
        name = signal.Signals(sig).name
        if self.should_exit:
            os.write(2, f"serve: {name} again: exiting now\n".encode())  # print may re-enter
            os._exit(128 + sig)
        print(f"serve: {name}: shutting down (in-flight requests get {self.drain_s:g} s; a "
              "second signal exits at once)", file=sys.stderr, flush=True)
        timer = threading.Timer(self.drain_s, self.host.cut, ("the server is shutting down",))
        timer.daemon = True
        timer.start()
        super().handle_exit(sig, frame)
