"""deltaserve: inference for Qwen3.5 hybrid models and MiniCPM-V-4.6."""

from __future__ import annotations

import importlib

__all__ = ["LLM", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"

# imported on first use (PEP 562): `deltaserve --help` and argument parsing never load torch
_HOMES = {"LLM": "deltaserve.engine.llm", "EngineArgs": "deltaserve.engine.args",
          "SamplingParams": "deltaserve.engine.sampling",
          "RequestOutput": "deltaserve.engine.outputs",
          "CompletionOutput": "deltaserve.engine.outputs"}


def __getattr__(name: str):
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'deltaserve' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted((*globals(), *_HOMES))
