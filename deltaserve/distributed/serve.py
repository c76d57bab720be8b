"""`serve --tp N`: rank 0 runs the HTTP server and its engine loop (server/bridge.py); ranks 1..N-1
run `follow`, no HTTP. Before rank 0 applies a batch of commands (add, abort, a call every rank
makes) and then steps if its engine has work, it broadcasts the batch on a CPU-side gloo channel;
each rank applies the same batch to its identical engine and steps under the same condition, so
every rank runs the same forwards and collectives in the same order.

Guarantees: an idle rank 0 sends nothing but a heartbeat every HEARTBEAT_S (the other ranks block
in the broadcast, no spinning); rank 0's loop ending (shutdown or engine failure) sends
("shutdown",); a rank that dies closes its sockets, so the others' next collective raises and
they exit; a live but stuck rank 0 is given up on after CHANNEL_TIMEOUT_S.
"""

from __future__ import annotations

import dataclasses
import functools
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

HEARTBEAT_S = 30.0  # an idle rank 0 says "still here" this often
CHANNEL_TIMEOUT_S = 1800.0  # covers rank 0's slowest silence: quantizing a checkpoint before load
SHUTDOWN = ("shutdown",)


class Mirror:
    """The command channel of a serving group: rank 0 publishes, the others receive."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        # objects travel on gloo (CPU) even when the model's group is NCCL
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=CHANNEL_TIMEOUT_S))
        self.closed = False
        self.last_sent = time.monotonic()
        self.on_close: Callable[[str | None], None] | None = None  # rank 0: the error, if any
        self._lock = threading.Lock()  # the load thread and then the engine thread publish

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def publish(self, cmds: list) -> None:
        """Rank 0: broadcast one batch (wire form: picklable, tensors on the CPU)."""
        with self._lock:
            if not self.closed:
                self._send(cmds)

    def _send(self, cmds: list) -> None:
        dist.broadcast_object_list([cmds], src=0, group=self.group)
        self.last_sent = time.monotonic()

    def receive(self) -> list:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def idle(self) -> None:
        """Rank 0's loop has nothing to do: a heartbeat when one is due."""
        if time.monotonic() - self.last_sent >= HEARTBEAT_S:
            self.publish([])

    def close(self, error: str | None = None) -> None:
        """Rank 0: tell the others to exit (best effort: a dead peer's socket raises), once."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            try:
                self._send([SHUTDOWN])
            except Exception as exc:  # the group is broken: the others fail on their own
                print(f"serve: could not send shutdown to the other ranks: {exc}",
                      file=sys.stderr, flush=True)
        if self.on_close is not None:
            self.on_close(error)


def wire(cmd: tuple) -> tuple | None:
    """A driver command as the other ranks apply it, or None for one rank 0 keeps to itself
    (a plain call: the vision tower, which runs no collective and changes no engine state)."""
    kind = cmd[0]
    if kind == "add":
        _, rid, ids, params, _, _, images, _ = cmd
        if images is not None:  # rank 0's device is not theirs
            images = dataclasses.replace(images, embeds=images.embeds.cpu())
        return ("add", rid, list(ids), params, images)
    if kind == "abort":
        return cmd
    if kind == "call" and cmd[4] is not None:
        return ("call", *cmd[4])
    return None


def apply(llm, cmd: tuple) -> bool:
    """One received command on a following rank; False for shutdown. Errors the same command
    raised on rank 0 (a refused add, a failed call) were answered there: here they are dropped."""
    engine = llm.engine
    if cmd[0] == "shutdown":
        return False
    if cmd[0] == "add":
        _, rid, ids, params, images = cmd
        if images is not None:
            images = dataclasses.replace(images, embeds=images.embeds.to(llm.device))
        try:
            engine.add_request(rid, ids, params, images)
        except Exception:  # rank 0 raised the same and answered the client
            pass
    elif cmd[0] == "abort":
        engine.abort(cmd[1])  # unknown or finished: a no-op, as on rank 0
    elif cmd[0] == "call":
        fn, args = cmd[1], cmd[2]
        try:
            fn(llm, *args)
        except Exception:  # rank 0 hands its own copy to the caller
            pass
    return True


def follow(mirror: Mirror, build: Callable[[str], object]) -> int:
    """A following rank's whole life: build the model when rank 0 loads it (build(path)), then
    apply each batch and step when the engine has work, until shutdown."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # rank 0 decides when the group stops
        signal.signal(sig, signal.SIG_IGN)
    llm = None
    while True:
        for cmd in mirror.receive():
            if cmd[0] == "load":
                llm = loaded(mirror, functools.partial(build, cmd[1]))
            elif not apply(llm, cmd):
                return 0
        if llm is not None and llm.engine.has_work:
            llm.engine.step()


def loaded(mirror: Mirror, build: Callable[[], object]):
    """build() on every rank, then one exchange: every rank must have loaded, and with pools of
    the same size (each rank schedules alone, so they must agree; on GPUs each rank sizes its
    pools from its own free memory). A rank that failed still joins the exchange, so the others
    fail with it instead of waiting in the next collective."""
    from deltaserve.errors import ConfigError

    llm, error = None, None
    try:
        llm = build()
        cfg = llm.engine.cache.config
        mine = (cfg.num_slots, cfg.num_blocks)
    except Exception as exc:
        error, mine = exc, None
    every = [None] * mirror.world_size
    dist.all_gather_object(every, mine, group=mirror.group)
    if error is not None:
        raise error
    if None in every:
        raise ConfigError(f"rank {every.index(None)} failed to load the model (its log says why)")
    if len(set(every)) > 1:
        raise ConfigError(f"the ranks sized different KV pools (slots, blocks): {every}; pass "
                          "the same --max-model-len/--max-num-seqs on GPUs with equal free memory")
    return llm
