"""Held-out Python text for the demo model's perplexity: standard-library files it never trained on.

The text is a copy shipped beside the demo model, not read from the running interpreter:
some Python installs strip the standard library's .py sources, and a patch release may
touch a file. `scripts/demo_corpus.py` pins the training and held-out files and rewrites
the copy.
"""

from __future__ import annotations

from pathlib import Path

from lowvram.errors import ModelLoadError

FILE_SEPARATOR = "\n\n"
HELDOUT_PATH = Path(__file__).resolve().parent.parent / "demo_model" / "heldout_python.txt"


def heldout_text(max_chars: int | None = None) -> str:
    """The held-out Python text (about 186 KB), or its first `max_chars` characters."""
    if not HELDOUT_PATH.is_file():
        raise ModelLoadError(f"the held-out Python text is missing from {HELDOUT_PATH}; reinstall lowvram")
    text = HELDOUT_PATH.read_text(encoding="utf-8")
    return text if max_chars is None else text[:max_chars]
