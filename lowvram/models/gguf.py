"""GGUF files in: each file is dequantized once into a Hugging Face checkpoint in the user's
cache (FP16 safetensors, config, its own tokenizer, chat template and generation settings),
which then loads, and quantizes where the profile says so, like any other checkpoint.

transformers reads the file through the `gguf` package (the optional `lowvram[gguf]` extra).
The cached copy is keyed by the file's size and SHA-256 and written under a temporary name,
then renamed, so an interrupted conversion leaves nothing that looks finished.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from lowvram.errors import ModelLoadError, UnsupportedModelError
from lowvram.paths import user_data_dir

# GGUF architecture -> what lowvram runs it as
SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
EXTRA_HINT = 'pip install "lowvram[gguf]"'
DONE_FILE = "lowvram-gguf.json"  # written last: a directory without it is not a finished conversion
# A one-time stage of minutes: said at WARNING so the CLI's default level and the chat's log panel show it
announce = logging.getLogger("lowvram").warning


def file_key(path: Path, progress: Callable[[str], None] = lambda _: None) -> str:
    """'<stem>-<size>-<first 16 hex digits of SHA-256>'."""
    size = path.stat().st_size
    if size > 256 << 20:
        progress(f"hashing {path.name} ({size / 2**30:.1f} GiB) to find its converted copy")
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(8 << 20):
            digest.update(chunk)
    return f"{path.stem}-{size}-{digest.hexdigest()[:16]}"


def gguf_architecture(path: Path) -> str:
    """The file's general.architecture, read from its header only."""
    _require_gguf()
    from gguf import GGUFReader

    try:
        field = GGUFReader(path).fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode()
    except (KeyError, ValueError, OSError) as exc:
        raise ModelLoadError(f"{path} is not a readable GGUF file ({exc}); check the download") from None


def _require_gguf() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ModelLoadError(f"reading GGUF files needs the optional GGUF support ({', '.join(missing)}): {EXTRA_HINT}")


def convert_gguf(
    path: str | os.PathLike, cache_root: Path | None = None, progress: Callable[[str], None] = announce
) -> Path:
    """The Hugging Face checkpoint directory of a GGUF file, converted on first use."""
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {str(path)!r} does not exist")
    architecture = gguf_architecture(path)
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path.name} is a {architecture!r} model; lowvram runs GGUF files of "
            f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))} models (and Hugging Face checkpoints of DeepSeek-V2)"
        )
    root = cache_root or user_data_dir("gguf")
    target = root / file_key(path, progress)
    if (target / DONE_FILE).is_file():
        return target
    size_gib = path.stat().st_size / 2**30
    progress(
        f"converting {path.name} ({architecture}, {size_gib:.2f} GiB) to FP16 once, into {target} "
        f"(roughly {max(1, round(3 * size_gib))} min on a laptop CPU)"
    )
    started = time.monotonic()
    partial = root / f".{target.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        _write_checkpoint(path, architecture, partial)
        (partial / DONE_FILE).write_text(json.dumps({"source": str(path), "architecture": architecture}) + "\n")
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    progress(f"converted {path.name} in {time.monotonic() - started:.0f} s")
    return target


def _write_checkpoint(path: Path, architecture: str, out: Path) -> None:
    """FP16 safetensors, config.json, tokenizer and generation config of the GGUF at `path`."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out.mkdir(parents=True)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config |= {"architectures": [SUPPORTED_ARCHITECTURES[architecture]], "dtype": "float16", "torch_dtype": "float16"}
    config.setdefault("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 10000.0))  # older readers
    state = {name: tensor.to(torch.float16).contiguous() for name, tensor in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    del model
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer.save_pretrained(out)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    ).save_pretrained(out)
