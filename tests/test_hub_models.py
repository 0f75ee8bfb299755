"""`lowvram pull`, `list` and `rm`, and --model ORG/NAME, over a Hugging Face cache built in tmp (no network)."""

import hashlib
import json
import shutil
import sys
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import errors as hub_errors

from lowvram.cli import main
from lowvram.errors import ModelLoadError
from lowvram.models.hub import list_models
from lowvram.models.loader import resolve_model_path
from lowvram.paths import model_identity

REPO_ID = "org/tiny"
REVISION = "0123456789abcdef0123456789abcdef01234567"


def put_in_cache(model_dir: Path, cache: Path, repo_id: str = REPO_ID) -> Path:
    """Lay `model_dir` out as huggingface_hub does: blobs by hash, a snapshot of links, refs/main."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for path in sorted(model_dir.iterdir()):
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / path.name).symlink_to(Path("../..") / "blobs" / blob.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty hub cache and user data dir, both in tmp, and no network."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hub"


@pytest.fixture
def pulled(cache, tiny_qwen2_dir):
    return put_in_cache(tiny_qwen2_dir, cache)


def _awq_copy(snapshot: Path, data_root: Path) -> Path:
    """What `--quantize` leaves: a folder named after the settings and the source's fingerprint."""
    copy = data_root / "lowvram" / "quantized" / f"org--tiny-awq-g32-f0.0-r0-{model_identity(snapshot)[:12]}"
    copy.mkdir(parents=True)
    shutil.copy(snapshot / "config.json", copy / "config.json")
    (copy / "model.safetensors").write_bytes(b"x" * 4096)
    return copy


def test_list_shows_the_cached_model_its_size_and_that_it_runs(pulled, tmp_path, capsys):
    copy = _awq_copy(pulled, tmp_path / "data")
    [model] = list_models()
    assert model.name == REPO_ID and model.is_runnable and model.architecture == "Qwen2ForCausalLM"
    assert model.size_bytes == sum(p.stat().st_size for p in pulled.iterdir())
    assert [c.path for c in model.copies] == [copy]
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert REPO_ID in out and "Qwen2ForCausalLM" in out and "yes" in out and "MiB" in out
    assert copy.name in out and "AWQ INT4 copy" in out


def test_list_says_why_a_model_does_not_run(cache, tmp_path, capsys):
    other = tmp_path / "bert"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    (other / "model.safetensors").write_bytes(b"x")
    put_in_cache(other, cache, "org/bert")
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "org/bert" in out and "no: BertModel is not supported" in out


def test_an_empty_cache_says_how_to_pull(cache, capsys):
    assert main(["list"]) == 0
    assert "lowvram pull" in capsys.readouterr().out


def test_model_by_hub_id_resolves_from_the_cache_offline(pulled, monkeypatch, capsys):
    def no_network(*args, **kwargs):
        assert kwargs.get("local_files_only"), "a cached model must load without asking the hub"
        assert "*.safetensors" in kwargs["allow_patterns"]  # else files lowvram never fetched count as missing
        return real(*args, **kwargs)

    real = huggingface_hub.snapshot_download
    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)
    assert resolve_model_path(REPO_ID) == pulled
    assert main(["generate", "--model", REPO_ID, "--device", "cpu", "-p", "hi", "-n", "2"]) == 0


def test_an_awq_copy_resolves_by_the_name_list_shows(pulled, tmp_path):
    copy = _awq_copy(pulled, tmp_path / "data")
    assert resolve_model_path(copy.name) == copy


def test_a_hub_id_not_in_the_cache_offline_names_hf_download(cache):
    with pytest.raises(ModelLoadError, match="needs network.*`hf download org/missing --local-dir DIR`"):
        resolve_model_path("org/missing")


def test_rm_asks_then_deletes_the_model_and_its_copies(pulled, tmp_path, monkeypatch, capsys):
    copy = _awq_copy(pulled, tmp_path / "data")
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    monkeypatch.setattr("builtins.input", lambda prompt: "n")
    assert main(["rm", REPO_ID]) == 1
    assert pulled.exists() and copy.exists() and "nothing deleted" in capsys.readouterr().out
    monkeypatch.setattr("builtins.input", lambda prompt: "y")
    assert main(["rm", REPO_ID]) == 0
    assert "freed" in capsys.readouterr().out
    assert not pulled.exists() and not copy.exists() and list_models() == []


def test_rm_yes_needs_no_terminal_and_says_what_it_freed(pulled, capsys):
    size = sum(p.stat().st_size for p in pulled.iterdir())
    assert main(["rm", REPO_ID, "--yes"]) == 0
    assert f"freed {size / 2**20:.1f} MiB" in capsys.readouterr().out
    assert not (pulled.parents[1]).exists()


def test_rm_without_a_terminal_or_yes_refuses(pulled, monkeypatch, capsys):
    monkeypatch.setattr(sys.stdin, "isatty", lambda: False)
    assert main(["rm", REPO_ID]) == 2
    assert "--yes" in capsys.readouterr().err and pulled.exists()


def test_rm_of_an_unknown_name_is_one_clean_line(pulled, capsys):
    assert main(["rm", "org/nope", "--yes"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lowvram: error: no model named 'org/nope'") and "lowvram list" in err
    assert err.count("\n") == 1 and pulled.exists()


def test_pull_offline_is_one_line_naming_a_local_directory(cache, capsys):
    assert main(["pull", REPO_ID]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs network" in err
    assert f"hf download {REPO_ID} --local-dir DIR" in err and "--model DIR" in err


def test_pull_without_network_is_one_line_too(cache, monkeypatch, capsys):
    monkeypatch.delenv("HF_HUB_OFFLINE")

    def unreachable(*args, **kwargs):
        raise hub_errors.LocalEntryNotFoundError("cannot reach the hub")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    assert main(["pull", REPO_ID]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs network" in err and "hf download" in err


def test_pull_downloads_into_the_cache_and_quantizes_once(cache, tiny_qwen2_dir, monkeypatch, capsys):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    calls = []

    def download(repo_id, **kwargs):
        calls.append(kwargs)
        snapshot = cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / REVISION
        if kwargs.get("local_files_only") or snapshot.exists():
            return str(snapshot)
        return str(put_in_cache(tiny_qwen2_dir, Path(kwargs["cache_dir"]), repo_id))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    assert main(["pull", REPO_ID, "--quantize", "--profile", "cpu", "--device", "cpu", "--num-samples", "2"]) == 0
    assert calls[0]["cache_dir"] == cache and "*.safetensors" in calls[0]["allow_patterns"]
    out = capsys.readouterr().out
    [model] = list_models()
    [copy] = model.copies
    assert f"AWQ INT4 copy: {copy.path}" in out and copy.name.startswith("org--tiny-awq-")
    assert json.loads((copy.path / "config.json").read_text())["quantization_config"]["quant_method"] == "awq"
    assert main(["pull", REPO_ID, "--quantize", "--profile", "cpu", "--device", "cpu", "--num-samples", "2"]) == 0
    assert "made earlier" in capsys.readouterr().err and [c.path for c in list_models()[0].copies] == [copy.path]


def test_quantize_and_serve_take_the_hub_id(pulled, tmp_path, capsys):
    from lowvram.server.cli import served_name

    assert served_name(REPO_ID, pulled) == REPO_ID
    out = tmp_path / "int4"
    assert main(["quantize", REPO_ID, str(out), "--num-samples", "2", "--seq-len", "16", "--device", "cpu"]) == 0
    assert (out / "config.json").is_file()


def test_list_shows_gguf_conversions_and_rm_takes_a_copy_by_name(pulled, tmp_path, capsys):
    converted = tmp_path / "data" / "lowvram" / "gguf" / "qwen-q4-123-abcdef"
    converted.mkdir(parents=True)
    shutil.copy(pulled / "config.json", converted / "config.json")
    (converted / "model.safetensors").write_bytes(b"x" * 2**20)
    (converted / "lowvram-gguf.json").write_text("{}")
    copy = _awq_copy(pulled, tmp_path / "data")
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "qwen-q4-123-abcdef" in out and "from GGUF" in out and "1.0 MiB" in out
    assert main(["rm", converted.name, "--yes"]) == 0 and main(["rm", copy.name, "--yes"]) == 0
    assert not converted.exists() and not copy.exists() and pulled.exists()


def test_doctor_reads_a_cached_model_offline(pulled, capsys):
    assert main(["doctor", "--model", REPO_ID, "--quick", "--device", "cpu"]) == 0
    assert REPO_ID in capsys.readouterr().out


@pytest.mark.parametrize("command", [["download", "--help"], ["auth", "login", "--help"]])
def test_the_hf_commands_the_hints_name_exist(command):
    import subprocess

    result = subprocess.run([sys.executable, "-m", "huggingface_hub.cli.hf", *command], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert command[0] != "download" or "--local-dir" in result.stdout
