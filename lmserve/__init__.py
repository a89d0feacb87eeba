"""lmserve: a small, fast, correct LLM inference engine."""

from lmserve.config import EngineConfig
from lmserve.engine import Engine, EngineStats
from lmserve.llm import LLM
from lmserve.lora import LoRARequest
from lmserve.outputs import CompletionOutput, EmbeddingRequestOutput, RequestOutput
from lmserve.pooling import PoolingParams
from lmserve.sequence import SamplingParams, StructuredOutputsParams
from lmserve.version import __version__

__all__ = ["LLM", "Engine", "EngineConfig", "EngineStats", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput",
           "LoRARequest", "PoolingParams", "EmbeddingRequestOutput", "__version__"]
