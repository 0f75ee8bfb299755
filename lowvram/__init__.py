"""lowvram: DeepSeek-family LLMs on 4 GB GPUs."""

from lowvram.errors import LowvramError
from lowvram.llm import LLM
from lowvram.outputs import CompletionOutput, RequestOutput
from lowvram.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "LowvramError"]
__version__ = "0.1.0"
