"""Held-out Python text for the demo model's perplexity: standard-library files it never trained
on, shipped as a copy (some installs strip the .py sources; `scripts/demo_corpus.py` rewrites it)."""

from __future__ import annotations

from pathlib import Path

from lowvram.errors import ModelLoadError

FILE_SEPARATOR = "\n\n"
HELDOUT_PATH = Path(__file__).resolve().parent.parent / "demo_model" / "heldout_python.txt"


def heldout_text(max_chars: int | None = None) -> str:
    """The held-out Python text (about 186 KB), or its first `max_chars` characters."""
    if not HELDOUT_PATH.is_file():
        raise ModelLoadError(f"the held-out Python text is missing from {HELDOUT_PATH}; reinstall lowvram")
    return HELDOUT_PATH.read_text(encoding="utf-8")[:max_chars]
