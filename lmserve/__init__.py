"""lmserve: a small, fast, correct LLM inference engine."""

from lmserve.config import EngineConfig
from lmserve.engine import Engine, EngineStats
from lmserve.llm import LLM
from lmserve.outputs import CompletionOutput, RequestOutput
from lmserve.sequence import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "Engine", "EngineConfig", "EngineStats", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
