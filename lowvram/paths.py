"""Where lowvram keeps the user's files: $XDG_DATA_HOME/lowvram, else ~/.local/share/lowvram."""

import os
from pathlib import Path


def user_data_dir(*parts: str) -> Path:
    """The data directory (or a folder in it); not created here."""
    base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return base.joinpath("lowvram", *parts)
