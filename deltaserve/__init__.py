"""deltaserve: inference for Qwen3.5 hybrid models and MiniCPM-V-4.6."""

from deltaserve.engine.args import EngineArgs
from deltaserve.engine.llm import LLM
from deltaserve.engine.outputs import CompletionOutput, RequestOutput
from deltaserve.engine.sampling import SamplingParams

__all__ = ["LLM", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
