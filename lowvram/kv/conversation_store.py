"""Save a conversation's KV pages and restore them into the prefix cache, so the next turn
skips their prefill. File: safetensors, `layer.{i}.{k,v[,k_scale,k_zero,v_scale,v_zero]}`
[num_pages, block_size, ...], metadata naming the model, formats, page size and token ids.
A mismatch or a damaged file is reported and the conversation recomputed: never wrong output.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lowvram.errors import RequestError
from lowvram.kv.pool import _tensors
from lowvram.paths import model_identity, user_data_dir

log = logging.getLogger("lowvram")
FORMAT = "lowvram-kv-conversation"
VERSION = "1"


@dataclass
class RestoreResult:
    is_restored: bool
    num_tokens: int
    message: str
    seconds: float
    token_ids: list[int]


def _expected_metadata(engine) -> dict[str, str]:
    return {
        "format": FORMAT,
        "version": VERSION,
        "model": model_identity(engine.model_dir),
        "weight_format": "awq" if getattr(engine.config, "quantization", None) else "fp16",
        "kv_precision": engine.kv_precision,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "block_size": str(engine.block_manager.block_size),
        "num_layers": str(engine.config.num_layers),
    }


def save_conversation(engine, token_ids: list[int], path: str | Path | None = None) -> Path:
    """Write the KV pages of `token_ids` (computing them if needed) to `path`."""
    from safetensors.torch import save_file

    if len(token_ids) < 2:
        raise RequestError("a conversation needs at least 2 tokens to save")
    bm = engine.block_manager
    match = bm.match_prefix(token_ids + [0])  # +1: match_prefix always leaves one token to compute
    if match.num_tokens < len(token_ids):
        engine.score(token_ids)  # prefill through the cache: the pages are committed and stay cached
        match = bm.match_prefix(token_ids + [0])
    blocks = list(match.block_ids) + ([match.copy_from] if match.copy_from is not None else [])
    if match.num_tokens != len(token_ids):
        raise RequestError(
            f"only {match.num_tokens} of {len(token_ids)} tokens could be kept in the KV pool to save; "
            "raise the profile's memory budget or shorten the conversation"
        )
    pool = engine.kv_pool
    pool.ensure_resident(blocks)
    index = torch.tensor(pool.device_table(blocks), dtype=torch.long, device=engine.device)
    tensors = {
        f"layer.{i}.{name}": tensor.index_select(0, index).cpu().contiguous()
        for i, pages in enumerate(pool.pages)
        for name, tensor in _tensors(pages)
    }
    metadata = dict(
        _expected_metadata(engine), token_ids=json.dumps(token_ids), saved_at=time.strftime("%Y-%m-%dT%H:%M:%S")
    )
    if path is None:
        path = user_data_dir("conversations") / f"conversation-{time.strftime('%Y%m%d-%H%M%S')}.kv"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")  # a crash never leaves a half-written file under `path`
    try:
        save_file(tensors, tmp, metadata=metadata)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def restore_conversation(engine, path: str | Path) -> RestoreResult:
    """Load a saved conversation's pages into the prefix cache, if it fits this engine."""
    from safetensors import SafetensorError, safe_open

    start = time.perf_counter()
    path = Path(path)

    def fallback(reason: str) -> RestoreResult:
        message = f"could not restore {path.name}: {reason}; the conversation will be recomputed"
        log.warning(message)
        return RestoreResult(False, 0, message, time.perf_counter() - start, [])

    if not path.is_file():
        return fallback("the file does not exist")
    try:
        file = safe_open(path, framework="pt")  # a memory map: tensors are read one at a time
        meta = file.metadata() or {}
        token_ids = [int(t) for t in json.loads(meta.get("token_ids", "[]"))]
    except (OSError, SafetensorError, ValueError):
        return fallback("the file is damaged or not a saved conversation")
    for key, value in _expected_metadata(engine).items():
        if meta.get(key) != value:
            return fallback(f"it was saved with {key} = {meta.get(key)!r}, this engine has {value!r}")
    bm = engine.block_manager
    num_pages = bm.blocks_for(len(token_ids))
    if num_pages > bm.num_free_blocks:
        return fallback(f"it needs {num_pages} KV pages and {bm.num_free_blocks} are free")
    if engine.has_unfinished_requests():
        return fallback("requests are running; restore between turns")
    seq_id = -1 - int(time.monotonic_ns() % 1_000_000_000)
    try:
        blocks = list(bm.allocate(seq_id, len(token_ids)))
        pool = engine.kv_pool
        pool.ensure_resident(blocks, free_block_ids=blocks)  # fresh pages: nothing to bring back
        index = torch.tensor(pool.device_table(blocks), dtype=torch.long, device=engine.device)
        for i, pages in enumerate(pool.pages):
            for name, target in _tensors(pages):
                source = file.get_tensor(f"layer.{i}.{name}")
                if source.dtype != target.dtype or source.shape[1:] != target.shape[1:] or len(source) != num_pages:
                    raise ValueError(f"layer.{i}.{name} is {source.dtype} {list(source.shape)}, not as the pool")
                target.index_copy_(0, index, source.to(engine.device))
        bm.commit(seq_id, token_ids, len(token_ids))
        bm.commit_partial(seq_id, token_ids, len(token_ids))
    except (ValueError, KeyError, TypeError, SafetensorError) as exc:
        bm.free(seq_id)
        return fallback(f"the file is damaged ({exc})")
    bm.free(seq_id)  # the pages stay cached, ready for the next turn
    seconds = time.perf_counter() - start
    message = f"restored {len(token_ids)} tokens in {seconds * 1000:.0f} ms"
    return RestoreResult(True, len(token_ids), message, seconds, token_ids)
