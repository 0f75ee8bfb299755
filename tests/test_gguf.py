"""GGUF files in: the errors a user can hit, and conversions that never leave half a checkpoint."""

import pytest

from lowvram.errors import ModelLoadError, UnsupportedModelError
from lowvram.models import gguf as gguf_module


def write_gguf(path, architecture: str):
    """A header-only GGUF file naming `architecture` (enough for the checks before conversion)."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="GGUF file .* does not exist"):
        gguf_module.convert_gguf(tmp_path / "nothing.gguf", cache_root=tmp_path)


def test_missing_optional_support_names_the_extra(tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "m.gguf", "llama")
    real_find_spec = gguf_module.importlib.util.find_spec
    monkeypatch.setattr(
        gguf_module.importlib.util, "find_spec", lambda name: None if name == "gguf" else real_find_spec(name)
    )
    with pytest.raises(ModelLoadError, match=r'pip install "lowvram\[gguf\]"'):
        gguf_module.convert_gguf(path, cache_root=tmp_path / "cache")


def test_unsupported_architecture_names_what_is_supported(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "gpt2")
    with pytest.raises(UnsupportedModelError, match="'gpt2' model; lowvram runs GGUF files of llama, qwen2"):
        gguf_module.convert_gguf(path, cache_root=tmp_path / "cache")


def test_not_a_gguf_file_is_a_clear_error(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        gguf_module.convert_gguf(path, cache_root=tmp_path / "cache")


def test_an_interrupted_conversion_leaves_nothing_and_a_finished_one_is_reused(tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "m.gguf", "llama")
    cache = tmp_path / "cache"

    def interrupted(source, architecture, out):
        out.mkdir(parents=True)
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_module, "_write_checkpoint", interrupted)
    with pytest.raises(KeyboardInterrupt):
        gguf_module.convert_gguf(path, cache_root=cache, progress=lambda _: None)
    assert list(cache.iterdir()) == []

    calls = []

    def finished(source, architecture, out):
        calls.append(architecture)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(gguf_module, "_write_checkpoint", finished)
    first = gguf_module.convert_gguf(path, cache_root=cache, progress=lambda _: None)
    again = gguf_module.convert_gguf(path, cache_root=cache, progress=lambda _: None)
    assert first == again and calls == ["llama"] and (first / gguf_module.DONE_FILE).is_file()
    # the key follows the content: a changed file converts again
    path.write_bytes(path.read_bytes() + b"\0" * 32)
    assert gguf_module.convert_gguf(path, cache_root=cache, progress=lambda _: None) != first


def test_cli_reports_a_missing_gguf_file_in_one_line(tmp_path, capsys):
    from lowvram.cli import main

    assert main(["generate", "--model", str(tmp_path / "x.gguf"), "-p", "hi"]) == 2
    err = capsys.readouterr().err
    assert "GGUF file" in err and "does not exist" in err and "Traceback" not in err
