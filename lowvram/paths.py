import hashlib
import os
from pathlib import Path


def user_data_dir(*parts: str) -> Path:
    """lowvram's data directory, $XDG_DATA_HOME/lowvram else ~/.local/share/lowvram (or a folder in it); not created."""
    base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return base.joinpath("lowvram", *parts)


def model_identity(model_dir: Path) -> str:
    """A fingerprint of config.json and the weight files' names and sizes (keys copies and saved KV)."""
    digest = hashlib.sha256()
    model_dir = Path(model_dir)
    config = model_dir / "config.json"
    digest.update(config.read_bytes() if config.is_file() else b"")
    for path in sorted(model_dir.glob("*.safetensors")):
        digest.update(f"{path.name}:{path.stat().st_size}".encode())
    return digest.hexdigest()[:32]
