"""The real-text yardstick of `lowvram bench quality --text real`: text that ships with every
Python (so it is there offline), short instructions written for this bench, and llama.cpp's
Q4_0, Q5_0 and Q8_0 formats of the same weights for comparison.

Prose is the Python reference manual as Python carries it (`pydoc_data.topics`, English); code
is the source of a fixed list of standard-library modules. Both depend on the Python version,
which the report names.
"""

from __future__ import annotations

import inspect
import json
import platform
import shutil
from dataclasses import dataclass
from importlib import import_module, resources
from pathlib import Path

PROSE_CHARS = 120_000
CODE_CHARS = 40_000
CODE_MODULES = ("textwrap", "heapq", "bisect", "fnmatch", "shlex", "string", "colorsys", "calendar", "difflib")
GGML_BITS = {"q4_0": 4.5, "q5_0": 5.5, "q8_0": 8.5}  # llama.cpp's block formats: 32 weights and an FP16 scale
LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def corpus_source() -> str:
    return (
        f"Python {platform.python_version()}'s reference manual (pydoc_data.topics, first {PROSE_CHARS:,} "
        f"characters) and the source of its {', '.join(CODE_MODULES)} modules (first {CODE_CHARS:,})"
    )


def real_text() -> str:
    """About 36K tokens of English prose and Python code, fixed for a given Python version."""
    from pydoc_data.topics import topics

    prose = "\n\n".join(topics[key].strip() for key in sorted(topics))[:PROSE_CHARS]
    code = "\n\n".join(inspect.getsource(import_module(name)) for name in CODE_MODULES)[:CODE_CHARS]
    return prose + "\n\n" + code


@dataclass
class Instruction:
    kind: str  # fact, arithmetic, code or format
    prompt: str

    @property
    def messages(self) -> list[dict]:
        return [{"role": "user", "content": self.prompt}]


def instructions() -> list[Instruction]:
    """The bench's short instructions (lowvram/data/instructions.jsonl)."""
    text = resources.files("lowvram").joinpath("data/instructions.jsonl").read_text()
    return [Instruction(**json.loads(line)) for line in text.splitlines() if line.strip()]


def ggml_roundtrip(model_dir: Path, out_dir: Path, fmt: str) -> float:
    """Write `model_dir` with every decoder linear's weight quantized to llama.cpp's `fmt`
    (q4_0, q5_0, q8_0: the gguf package's reference quantizer, blocks of 32 along the inputs)
    and back to FP16, so lowvram's FP16 path scores exactly that format's values. Embeddings,
    norms and the head stay as they were. Returns the weights' bytes in that format."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    from safetensors.torch import load_file, save_file

    qtype = GGMLQuantizationType[fmt.upper()]
    out_dir.mkdir(parents=True, exist_ok=True)
    total_bytes = 0.0
    for path in model_dir.iterdir():
        if path.suffix != ".safetensors":
            if path.is_file():
                shutil.copy2(path, out_dir / path.name)
            continue
        tensors = load_file(path)
        for name, tensor in tensors.items():
            is_linear = name.endswith(".weight") and name.removesuffix(".weight").endswith(LINEAR_SUFFIXES)
            if is_linear and tensor.shape[-1] % 32 == 0:
                weight = tensor.float().numpy()  # [out, in]: blocks run along the inputs
                restored = dequantize(quantize(weight, qtype), qtype)
                tensors[name] = torch.from_numpy(np.ascontiguousarray(restored)).to(tensor.dtype)
                total_bytes += tensor.numel() * GGML_BITS[fmt] / 8
            else:
                total_bytes += tensor.numel() * tensor.element_size()
        save_file(tensors, out_dir / path.name, metadata={"format": "pt"})
    return total_bytes
