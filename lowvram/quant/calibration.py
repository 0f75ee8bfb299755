"""Calibration text for quantization: the shipped corpus (`lowvram/data/calibration.jsonl`,
built by `scripts/build_calibration_corpus.py` from stdlib Python and the demo's training
chats, never held-out data), the user's own file, and AutoAWQ-style blocks of tokens.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from lowvram.errors import ConfigError

log = logging.getLogger("lowvram")

CALIBRATION_PATH = Path(__file__).resolve().parent.parent / "data" / "calibration.jsonl"
PLAIN_TEXT_PIECE_CHARS = 2000


def load_calibration_records(path: str | Path | None = None) -> list[dict]:
    """Records of the shipped corpus (path None) or of a user file: `.jsonl` (one record a line),
    else plain UTF-8 text cut at blank lines into ~2,000-character pieces. ConfigError for a
    missing, unreadable or empty file."""
    path = CALIBRATION_PATH if path is None else Path(path).expanduser()
    if not path.is_file() and path == CALIBRATION_PATH:
        raise ConfigError(
            "the shipped calibration corpus is missing from this install; reinstall lowvram or pass --calib FILE"
        )
    if not path.is_file():
        raise ConfigError(f"--calib {path}: no such file")
    try:
        content = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--calib {path}: cannot read it as UTF-8 text ({exc})") from None
    records = []
    if path.suffix == ".jsonl":
        for line_number, line in enumerate(content.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{line_number}: not valid JSON ({exc})") from None
            if not isinstance(record, dict) or not (
                isinstance(record.get("text"), str) or isinstance(record.get("messages"), list)
            ):
                raise ConfigError(f'{path}:{line_number}: a record must be {{"text": str}} or {{"messages": [...]}}')
            records.append(record)
    else:
        piece = ""
        for paragraph in content.split("\n\n"):
            piece = f"{piece}\n\n{paragraph}" if piece else paragraph
            if len(piece) >= PLAIN_TEXT_PIECE_CHARS:
                records.append({"text": piece})
                piece = ""
        if piece.strip():
            records.append({"text": piece})
    if not records:
        raise ConfigError(f"--calib {path}: the file holds no text")
    return records


def calibration_blocks(hf_tokenizer, records: list[dict], num_samples: int, seq_len: int) -> torch.Tensor:
    """Token ids [num_blocks, seq_len]: the records' tokens concatenated and cut into blocks;
    fewer than `num_samples` (with a warning) when the text runs out."""
    if num_samples < 1 or seq_len < 2:
        raise ConfigError(f"--num-samples {num_samples} and --seq-len {seq_len} must be at least 1 and 2")
    ids: list[int] = []
    for record in records:
        text, has_specials = record.get("text"), True
        if "text" not in record and getattr(hf_tokenizer, "chat_template", None):
            text, has_specials = hf_tokenizer.apply_chat_template(record["messages"], tokenize=False), False
        elif "text" not in record:
            text = "".join(f"{m.get('role', 'user').title()}: {m.get('content', '')}\n" for m in record["messages"])
        # verbose=False: records longer than the model's context are expected, they are cut into blocks
        ids.extend(hf_tokenizer.encode(text, add_special_tokens=has_specials, verbose=False))
        if len(ids) >= num_samples * seq_len:
            break
    num_blocks = min(num_samples, len(ids) // seq_len)
    if num_blocks == 0:
        raise ConfigError(
            f"the calibration text has {len(ids)} tokens, less than one --seq-len {seq_len} block; "
            "pass more text with --calib or lower --seq-len"
        )
    if num_blocks < num_samples:
        log.warning(
            f"calibration text gives {num_blocks} blocks of {seq_len} tokens, fewer than the {num_samples} requested"
        )
    return torch.tensor(ids[: num_blocks * seq_len], dtype=torch.long).view(num_blocks, seq_len)
