"""Calibration text for quantization: the shipped corpus, the user's own file, token blocks.

The shipped corpus (`lowvram/data/calibration.jsonl`, about 250 KB) is one JSON record per
line: `{"text": ...}` for Python source or `{"messages": [...]}` for a chat conversation. It
is built by `scripts/build_calibration_corpus.py` from the standard library's own sources (only the
files the demo model trains on, never its held-out ones) and from the synthetic chat tasks of
`lowvram.demo.tasks` (training keys only), so no third-party text is copied and the held-out
measurements stay unseen. Code and chat are what the DeepSeek models lowvram targets are
used for.

Samples are formed as AutoAWQ forms them: every record is tokenized (chat records through
the model's chat template), the token streams are concatenated, and the result is cut into
blocks of `seq_len` tokens.
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
    """Records from the shipped corpus (path None) or from a user file.

    A `.jsonl` file holds one record per line (`{"text": ...}` or `{"messages": [...]}`);
    any other file is read as plain UTF-8 text and cut at blank lines into pieces of about
    2,000 characters. Raises ConfigError for a missing, unreadable or empty file.
    """
    path = CALIBRATION_PATH if path is None else Path(path).expanduser()
    if not path.is_file():
        where = (
            "the shipped calibration corpus is missing from this install; reinstall lowvram or pass --calib FILE"
            if path == CALIBRATION_PATH
            else f"--calib {path}: no such file"
        )
        raise ConfigError(where)
    try:
        content = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--calib {path}: cannot read it as UTF-8 text ({exc})") from None
    records = _parse_jsonl(content, path) if path.suffix == ".jsonl" else _split_plain_text(content)
    if not records:
        raise ConfigError(f"--calib {path}: the file holds no text")
    return records


def _parse_jsonl(content: str, path: Path) -> list[dict]:
    records = []
    for line_number, line in enumerate(content.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{line_number}: not valid JSON ({exc})") from None
        is_text = isinstance(record, dict) and isinstance(record.get("text"), str)
        is_chat = isinstance(record, dict) and isinstance(record.get("messages"), list)
        if not (is_text or is_chat):
            raise ConfigError(f'{path}:{line_number}: a record must be {{"text": str}} or {{"messages": [...]}}')
        records.append(record)
    return records


def _split_plain_text(content: str) -> list[dict]:
    records, piece = [], ""
    for paragraph in content.split("\n\n"):
        piece = f"{piece}\n\n{paragraph}" if piece else paragraph
        if len(piece) >= PLAIN_TEXT_PIECE_CHARS:
            records.append({"text": piece})
            piece = ""
    if piece.strip():
        records.append({"text": piece})
    return records


def _record_ids(hf_tokenizer, record: dict) -> list[int]:
    # verbose=False: records longer than the model's context are expected, they are cut into blocks
    if "text" in record:
        return list(hf_tokenizer.encode(record["text"], add_special_tokens=True, verbose=False))
    messages = record["messages"]
    if getattr(hf_tokenizer, "chat_template", None):
        text = hf_tokenizer.apply_chat_template(messages, tokenize=False)
        return list(hf_tokenizer.encode(text, add_special_tokens=False, verbose=False))
    text = "".join(f"{m.get('role', 'user').title()}: {m.get('content', '')}\n" for m in messages)
    return list(hf_tokenizer.encode(text, add_special_tokens=True, verbose=False))


def calibration_blocks(hf_tokenizer, records: list[dict], num_samples: int, seq_len: int) -> torch.Tensor:
    """Token ids [num_blocks, seq_len]: the records' tokens concatenated and cut into blocks.

    Fewer than `num_samples` blocks are returned (with a warning) when the text runs out;
    ConfigError when it does not fill a single block.
    """
    if num_samples < 1 or seq_len < 2:
        raise ConfigError(f"--num-samples {num_samples} and --seq-len {seq_len} must be at least 1 and 2")
    needed = num_samples * seq_len
    ids: list[int] = []
    for record in records:
        ids.extend(_record_ids(hf_tokenizer, record))
        if len(ids) >= needed:
            break
    num_blocks = min(num_samples, len(ids) // seq_len)
    if num_blocks == 0:
        raise ConfigError(
            f"the calibration text has {len(ids)} tokens, less than one --seq-len {seq_len} block; "
            "pass more text with --calib or lower --seq-len"
        )
    if num_blocks < num_samples:
        log.warning(
            "calibration text gives %d blocks of %d tokens, fewer than the %d requested",
            num_blocks,
            seq_len,
            num_samples,
        )
    # blocks: [num_blocks, seq_len]
    return torch.tensor(ids[: num_blocks * seq_len], dtype=torch.long).view(num_blocks, seq_len)
