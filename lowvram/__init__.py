"""lowvram: DeepSeek-family LLMs on 4 GB GPUs. Subpackages (each docstring says what it may import):
`core`, `engine`, `kv`, `models`, `quant`, `memory`, `bench`, `server`, `kernels`, `tui`. The names
below load on first use, so importing a part of lowvram (the core, the CLI's help) needs no torch."""

import importlib

from lowvram.core.sampling_params import SamplingParams
from lowvram.errors import LowvramError

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "LowvramError"]
__version__ = "0.1.0"
_LAZY = {
    "LLM": "lowvram.engine.llm",
    "RequestOutput": "lowvram.engine.outputs",
    "CompletionOutput": "lowvram.engine.outputs",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lowvram' has no attribute {name!r}")
