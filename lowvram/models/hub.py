"""Models by name, over the Hugging Face cache: what `lowvram pull`, `list` and `rm` and a hub id given
as --model use. Downloads, the cache scan and deletion are huggingface_hub's own (snapshot_download,
scan_cache_dir, delete_revisions), so `hf download` and `hf cache` see the same models. A model in the
cache loads without asking the hub: once pulled it runs offline, and `lowvram pull` again updates it.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from lowvram.errors import ModelLoadError
from lowvram.paths import user_data_dir

# Not "*.safetensors" only: vLLM reads every *.safetensors file of a directory without an index and fails
# on tensor names it does not know, so the compensation tensors live in a file it never globs.
WEIGHT_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "tokenizer*"]


def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps models: $HF_HUB_CACHE, else $HF_HOME/hub, else its default."""
    if os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return Path(os.environ.get("HF_HUB_CACHE") or os.environ["HUGGINGFACE_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def is_offline() -> bool:
    """HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE, as huggingface_hub reads them, but read now (it reads them once)."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in {"1", "ON", "YES", "TRUE"}


def looks_like_hub_id(text: str) -> bool:
    """'org/name', and not a path (a path that exists is never a hub id)."""
    return text.count("/") == 1 and not text.startswith((".", "/", "~")) and not Path(text).exists()


def _download_hint(repo_id: str) -> str:
    return f"on a machine with network run `hf download {repo_id} --local-dir DIR`, copy DIR here and pass --model DIR"


def hub_patterns() -> list[str]:
    """The files lowvram fetches of a repository (and asks the cache for: others may be missing)."""
    from lowvram.models.checkpoint import COMPENSATION_FILE

    return [*WEIGHT_PATTERNS, COMPENSATION_FILE]


def cached_snapshot(repo_id: str) -> Path | None:
    """The cached snapshot of `repo_id` if it holds a config and weights (never asks the hub), else None."""
    from huggingface_hub import snapshot_download

    try:
        path = Path(
            snapshot_download(repo_id, cache_dir=hub_cache_dir(), local_files_only=True, allow_patterns=hub_patterns())
        )
    except Exception:  # not cached, incomplete, or not a valid id
        return None
    has_weights = any(path.glob("*.safetensors"))
    return path if (path / "config.json").is_file() and has_weights else None


def fetch(repo_id: str, *, verb: str = "fetch") -> Path:
    """Download (or update) `repo_id` into the cache with huggingface_hub's progress bars."""
    from huggingface_hub import errors, snapshot_download

    if is_offline():
        raise ModelLoadError(f"{verb}ing {repo_id} needs network, but HF_HUB_OFFLINE is set; {_download_hint(repo_id)}")
    try:
        return Path(snapshot_download(repo_id, cache_dir=hub_cache_dir(), allow_patterns=hub_patterns()))
    except errors.LocalEntryNotFoundError:  # the hub did not answer and the cache does not have it
        raise ModelLoadError(
            f"{verb}ing {repo_id} needs network, and the Hugging Face hub cannot be reached; {_download_hint(repo_id)}"
        ) from None
    except errors.GatedRepoError:
        raise ModelLoadError(
            f"{repo_id} is gated: accept its terms on huggingface.co, then log in with `hf auth login`"
        ) from None
    except errors.RepositoryNotFoundError:
        raise ModelLoadError(
            f"no model {repo_id!r} on the Hugging Face hub (or it is private: log in with `hf auth login`)"
        ) from None
    except Exception as exc:  # HTTP errors, a full disk, a bad id: the hub raises many types
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        raise ModelLoadError(f"could not {verb} {repo_id!r} from the Hugging Face hub ({reason})") from None


def resolve_hub_model(repo_id: str) -> Path:
    """The cached snapshot, else a fresh download (what --model ORG/NAME does)."""
    return cached_snapshot(repo_id) or fetch(repo_id)


def resolve_local_copy(name: str) -> Path | None:
    """A copy lowvram made (an AWQ INT4 copy or a GGUF conversion), by the name `lowvram list` shows it under."""
    if "/" in name or "\\" in name or name.startswith("."):
        return None
    for root in (user_data_dir("quantized"), user_data_dir("gguf")):
        if (root / name / "config.json").is_file():
            return root / name
    return None


@dataclass
class LocalModel:
    """One row of `lowvram list`: a hub model in the cache, or a copy lowvram made."""

    name: str  # the hub id, or the copy's folder name: what --model and `lowvram rm` take
    kind: str  # "hub", "awq" (an INT4 copy made by --quantize) or "gguf" (a converted GGUF file)
    path: Path
    size_bytes: int
    architecture: str | None
    is_runnable: bool
    note: str = ""
    revisions: list[str] = field(default_factory=list)  # hub: commit hashes, for delete_revisions
    copies: list[LocalModel] = field(default_factory=list)  # hub: its AWQ copies


def describe(model_dir: Path) -> tuple[str | None, bool, str]:
    """(architecture, whether lowvram runs it, why not) from config.json."""
    from lowvram.models.config import SUPPORTED_ARCHITECTURES
    from lowvram.models.deepseek_v2 import is_deepseek_v2

    try:
        raw = json.loads((model_dir / "config.json").read_text())
        arch = (raw.get("architectures") or [raw.get("model_type")])[0]
    except (OSError, ValueError, AttributeError, IndexError):
        return None, False, "no readable config.json"
    if not any(model_dir.glob("*.safetensors")):
        return arch, False, "no safetensors weights"
    if arch in SUPPORTED_ARCHITECTURES or is_deepseek_v2(raw):
        return arch, True, ""
    return arch, False, f"{arch} is not supported"


def _folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _copies(root: Path, marker: str) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / marker).is_file())


def list_models() -> list[LocalModel]:
    """The hub models in the cache, each with the AWQ copies made from it, then the GGUF conversions
    and any AWQ copy whose source is gone."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    from lowvram.kv.conversation_store import model_identity

    try:
        repos = [repo for repo in scan_cache_dir(hub_cache_dir()).repos if repo.repo_type == "model"]
    except CacheNotFound:
        repos = []
    awq = {path: model_identity_suffix(path) for path in _copies(user_data_dir("quantized"), "config.json")}
    models = []
    for repo in sorted(repos, key=lambda r: r.repo_id.lower()):
        revision = repo.refs.get("main") or max(repo.revisions, key=lambda r: r.last_modified)
        arch, is_runnable, note = describe(revision.snapshot_path)
        model = LocalModel(repo.repo_id, "hub", revision.snapshot_path, repo.size_on_disk, arch, is_runnable, note)
        model.revisions = [r.commit_hash for r in repo.revisions]
        identities = {model_identity(r.snapshot_path)[:12] for r in repo.revisions}
        for path in [path for path, suffix in awq.items() if suffix in identities]:
            model.copies.append(LocalModel(path.name, "awq", path, _folder_bytes(path), arch, is_runnable))
            del awq[path]
        models.append(model)
    for path in awq:
        models.append(LocalModel(path.name, "awq", path, _folder_bytes(path), *describe(path)))
    for path in _copies(user_data_dir("gguf"), "lowvram-gguf.json"):
        models.append(LocalModel(path.name, "gguf", path, _folder_bytes(path), *describe(path)))
    return models


def model_identity_suffix(copy_dir: Path) -> str:
    """The source model's fingerprint an AWQ copy's folder name ends with (see quant/cache.py)."""
    return copy_dir.name.rsplit("-", 1)[-1]


def find_model(name: str) -> LocalModel:
    """The listed model (or copy) called `name`; a clear error naming `lowvram list` otherwise."""
    for model in list_models():
        for candidate in (model, *model.copies):
            if candidate.name == name:
                return candidate
    raise ModelLoadError(
        f"no model named {name!r} in the Hugging Face cache ({hub_cache_dir()}) or lowvram's copies; "
        "`lowvram list` shows what is there"
    )


def remove(model: LocalModel) -> int:
    """Delete `model` (a hub model with its AWQ copies); the bytes freed."""
    freed = 0
    if model.kind == "hub":
        from huggingface_hub import scan_cache_dir

        strategy = scan_cache_dir(hub_cache_dir()).delete_revisions(*model.revisions)
        freed = strategy.expected_freed_size
        strategy.execute()
    for copy in model.copies if model.kind == "hub" else [model]:
        freed += copy.size_bytes
        shutil.rmtree(copy.path)
    return freed
