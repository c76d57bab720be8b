"""User-facing errors: one clear line, no traceback, at the CLI and server boundary."""

from __future__ import annotations


class DeltaserveError(Exception):
    """A problem the user can fix (bad file, bad argument, prompt too long); printed as one line."""


class CheckpointError(DeltaserveError):
    """A checkpoint folder, file or tensor is missing, corrupt or of the wrong shape."""


class ConfigError(DeltaserveError):
    """A config.json is missing fields, inconsistent, or names an unknown model_type."""


class RequestError(DeltaserveError):
    """A generation request is invalid (prompt over the context, bad sampling parameters)."""


class CapacityError(RequestError):
    """The engine cannot take this request now or ever (queue full, prompt larger than the KV pool)."""


class QueueFullError(CapacityError):
    """The waiting queue is at its bound: the same request may succeed later (a server's 503)."""
