"""Bad input gets a clear error naming the problem; the CLI exits 2 without a traceback."""

import json
import shutil
import subprocess
import sys

import pytest

from lowvram import LLM
from lowvram.errors import ModelLoadError, UnsupportedModelError


@pytest.fixture
def model_copy(tiny_qwen2_sharded_dir, tmp_path):
    return shutil.copytree(tiny_qwen2_sharded_dir, tmp_path / "model")


def _cli(*args, env_extra=None):
    import os

    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run(
        [sys.executable, "-m", "lowvram", *args], capture_output=True, text=True, env=env, timeout=120
    )


def _assert_clean_failure(result, *words):
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("lowvram: error: ")
    for word in words:
        assert word in result.stderr


def test_missing_config(model_copy):
    (model_copy / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="no config.json"):
        LLM(str(model_copy), profile="cpu")
    _assert_clean_failure(_cli("generate", "--model", str(model_copy), "-p", "hi"), "config.json")


def test_missing_shard(model_copy):
    shard = sorted(model_copy.glob("*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=shard.name):
        LLM(str(model_copy), profile="cpu")
    _assert_clean_failure(_cli("generate", "--model", str(model_copy), "-p", "hi"), shard.name, "missing")


def test_corrupt_safetensors(model_copy):
    shard = sorted(model_copy.glob("*.safetensors"))[0]
    shard.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="corrupt"):
        LLM(str(model_copy), profile="cpu")
    _assert_clean_failure(_cli("generate", "--model", str(model_copy), "-p", "hi"), shard.name, "corrupt")


def test_unsupported_architecture_lists_the_supported_ones(model_copy):
    config = json.loads((model_copy / "config.json").read_text())
    config["architectures"] = ["MistralForCausalLM"]
    (model_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="Qwen2ForCausalLM"):
        LLM(str(model_copy), profile="cpu")
    _assert_clean_failure(
        _cli("generate", "--model", str(model_copy), "-p", "hi"),
        "MistralForCausalLM",
        "LlamaForCausalLM",
        "Qwen2ForCausalLM",
        "DeepseekV2ForCausalLM",
    )


def test_a_field_with_a_bad_value_is_named(model_copy):
    config = json.loads((model_copy / "config.json").read_text())
    config["num_hidden_layers"] = "twenty"
    (model_copy / "config.json").write_text(json.dumps(config))
    _assert_clean_failure(_cli("generate", "--model", str(model_copy), "-p", "hi"), "'num_hidden_layers'", "'twenty'")


def test_truncated_index_json(model_copy):
    (model_copy / "model.safetensors.index.json").write_text("{")
    _assert_clean_failure(_cli("generate", "--model", str(model_copy), "-p", "hi"), "malformed")


def test_bad_profile_at_the_cli(tiny_qwen2_dir, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_num_seqs: -3\n")
    _assert_clean_failure(
        _cli("generate", "--model", str(tiny_qwen2_dir), "-p", "hi", "--profile", str(bad)), "max_num_seqs", "-3"
    )
    _assert_clean_failure(_cli("generate", "--model", str(tiny_qwen2_dir), "-p", "hi", "--profile", "huge"), "huge")


def test_missing_model_directory():
    _assert_clean_failure(_cli("generate", "--model", "./no/such/dir", "-p", "hi"), "does not exist")


def test_hub_id_offline_says_how_to_pass_a_local_path(tmp_path):
    result = _cli(
        "generate",
        "--model",
        "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
        "-p",
        "hi",
        env_extra={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)},
    )
    _assert_clean_failure(result, "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", "--model DIR")


def test_cli_generate_streams_and_reports_speed(tiny_qwen2_dir):
    result = _cli("generate", "--model", str(tiny_qwen2_dir), "-p", "hello", "-n", "8", "--profile", "cpu")
    assert result.returncode == 0, result.stderr
    assert "prefill" in result.stderr and "decode" in result.stderr and "tok/s" in result.stderr
    assert result.stdout.strip()


OOM_MESSAGE = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 3.81 GiB "
    "of which 1.02 GiB is free. Including non-PyTorch memory, this process has 2.78 GiB memory in use. Of the "
    "allocated memory 2.50 GiB is allocated by PyTorch, and 100.00 MiB is reserved by PyTorch but unallocated."
)


def test_doctor_explains_an_oom_message_pasted_as_the_argument():
    result = _cli("doctor", "--oom", OOM_MESSAGE)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert "2.00 GiB" in result.stdout and "1.02 GiB" in result.stdout
    _assert_clean_failure(_cli("doctor", "--oom", "no-such-file.txt"), "no such file", "in quotes")


def test_doctor_refuses_a_context_that_is_not_positive():
    _assert_clean_failure(_cli("doctor", "--context", "-5", "--quick"), "--context -5")


def test_doctor_for_cuda_without_a_gpu_fails():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    result = _cli("doctor", "--device", "cuda", "--quick")
    assert result.returncode == 1 and "no CUDA GPU" in result.stdout


def test_serve_refuses_a_port_out_of_range():
    _assert_clean_failure(_cli("serve", "--port", "70000"), "--port 70000", "65535")


def test_version():
    result = _cli("--version")
    assert result.returncode == 0 and result.stdout.startswith("lowvram ")


@pytest.mark.parametrize("command", [["generate", "-p", "count to a hundred:", "-n", "400"], ["chat", "--plain"]])
def test_a_reader_that_goes_away_ends_the_output_quietly(command):
    # `lowvram ... | head -c 1`: the pipe closes after the first byte
    proc = subprocess.Popen(
        [sys.executable, "-m", "lowvram", *command, "--raw"]
        if command[0] == "generate"
        else [sys.executable, "-m", "lowvram", *command],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdin.write(b"hello\nsay more\nand more\n" * 20)
    proc.stdin.close()
    proc.stdout.read(1)
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=120) in (0, 141)
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr
