import os
from pathlib import Path


def user_data_dir(*parts: str) -> Path:
    """lowvram's data directory, $XDG_DATA_HOME/lowvram else ~/.local/share/lowvram (or a folder in it); not created."""
    base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return base.joinpath("lowvram", *parts)
