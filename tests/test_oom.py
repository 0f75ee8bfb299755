"""Out-of-memory evidence: messages of several torch versions, crash reports, memory
snapshots, and `lowvram doctor --oom`."""

import io
import json
import pickle
import sys
from pathlib import Path

import pytest
import torch

from lowvram.errors import ConfigError
from lowvram.memory.crash_report import (
    EXIT_OUT_OF_MEMORY,
    crash_report_from_dict,
    default_crash_report_dir,
    format_doctor_hint,
    is_cuda_oom,
    report_cuda_oom,
    write_crash_report,
)
from lowvram.memory.oom import explain_oom, parse_oom_message, read_oom_input

CORPUS = Path(__file__).parent / "data" / "oom"
KIB, MIB, GIB = 2**10, 2**20, 2**30


def b(value, unit):
    return round(value * unit)


# file -> fields the parser must find (None where the message has no such number)
EXPECTED = {
    "torch_1_4_cached.txt": dict(
        source="torch<2.1",
        requested_bytes=b(20, MIB),
        total_bytes=b(3.95, GIB),
        allocated_bytes=b(3.36, GIB),
        free_bytes=b(7.19, MIB),
        reserved_unallocated_bytes=b(3.38, GIB) - b(3.36, GIB),
        device_index=0,
        exception_type="RuntimeError",
    ),
    "torch_1_8_reserved.txt": dict(
        source="torch<2.1",
        requested_bytes=b(64, MIB),
        total_bytes=b(3.82, GIB),
        allocated_bytes=b(2.71, GIB),
        free_bytes=b(13.31, MIB),
        reserved_unallocated_bytes=b(2.84, GIB) - b(2.71, GIB),
    ),
    "torch_1_12_allowed.txt": dict(
        source="torch<2.1",
        requested_bytes=b(512, MIB),
        allowed_bytes=b(3.60, GIB),
        free_bytes=b(19.12, GIB),
        allocated_bytes=b(3.41, GIB),
    ),
    "torch_1_13_request_too_large.txt": dict(
        source="torch<2.1",
        requested_bytes=b(18, GIB),
        total_bytes=b(14.75, GIB),
        exception_type="torch.cuda.OutOfMemoryError",
    ),
    "torch_2_1_capacty.txt": dict(
        source="torch>=2.1",
        requested_bytes=b(1.5, GIB),
        total_bytes=b(7.79, GIB),
        free_bytes=b(1.12, GIB),
        process_bytes=b(6.65, GIB),
        allocated_bytes=b(5.87, GIB),
        reserved_unallocated_bytes=b(401.23, MIB),
        other_processes=[],
    ),
    "torch_2_4_other_process_wrapped.txt": dict(
        source="torch>=2.1",
        requested_bytes=b(256, MIB),
        total_bytes=b(3.81, GIB),
        free_bytes=b(98.44, MIB),
        process_bytes=b(2.51, GIB),
        allocated_bytes=b(1.98, GIB),
        reserved_unallocated_bytes=b(95.36, MIB),
        other_processes=[(4121, b(1.20, GIB))],
        exception_type="torch.OutOfMemoryError",
    ),
    "torch_2_5_private_pools.txt": dict(
        source="torch>=2.1",
        requested_bytes=b(768, MIB),
        allocated_bytes=b(21.92, GIB),
        private_pool_bytes=b(104, MIB),
        reserved_unallocated_bytes=b(797.79, MIB),
    ),
    # In a container torch prints its own process as "Process N"; one holding at least what torch reserved is it.
    "torch_2_6_container_pid.txt": dict(
        source="torch>=2.1",
        requested_bytes=b(2, MIB),
        free_bytes=b(896, KIB),
        process_bytes=b(5.78, GIB),
        other_processes=[],
    ),
    "torch_2_8_fragmented.txt": dict(
        source="torch>=2.1",
        requested_bytes=b(384, MIB),
        free_bytes=0,
        allocated_bytes=b(4.01, GIB),
        reserved_unallocated_bytes=b(1.20, GIB),
    ),
    "hip_rocm.txt": dict(
        source="torch>=2.1",
        backend="HIP",
        requested_bytes=b(2, GIB),
        total_bytes=b(15.98, GIB),
        free_bytes=b(1.21, GIB),
        allocated_bytes=b(13.96, GIB),
        process_bytes=None,
    ),
    "mps.txt": dict(
        source="mps",
        backend="MPS",
        requested_bytes=b(256, MIB),
        allocated_bytes=b(17.75, GIB),
        allowed_bytes=b(18.13, GIB),
    ),
    "cuda_driver_error.txt": dict(source="driver", requested_bytes=None, total_bytes=None),
    "cublas_alloc_failed.txt": dict(source="driver", requested_bytes=None),
    "lowvram_plan.txt": dict(source="lowvram-plan", requested_bytes=b(3.88, GIB), total_bytes=b(3.60, GIB)),
}


def test_the_corpus_covers_several_torch_versions():
    assert sorted(p.name for p in CORPUS.glob("*.txt")) == sorted(EXPECTED)
    sources = {fields["source"] for fields in EXPECTED.values()}
    assert {"torch<2.1", "torch>=2.1", "mps", "driver", "lowvram-plan"} <= sources


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_corpus_message_parses_to_the_right_numbers(name):
    facts = parse_oom_message((CORPUS / name).read_text())
    assert facts is not None
    for field, value in EXPECTED[name].items():
        assert getattr(facts, field) == value, field
    assert explain_oom(facts), "every message gets an explanation"


def _changes(name):
    return " ".join(f.change for f in explain_oom(parse_oom_message((CORPUS / name).read_text())))


def test_explanations_name_the_cause_and_the_change():
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in _changes("torch_2_8_fragmented.txt")
    assert "PYTORCH_HIP_ALLOC_CONF" not in _changes("torch_2_8_fragmented.txt")
    # 3.81 GiB card, 1.20 GiB held by another process: plan for 95% of the 2.61 GiB left
    assert "memory_budget_gib: 2.5" in _changes("torch_2_4_other_process_wrapped.txt")
    assert "max_num_batched_tokens" in _changes("torch_1_13_request_too_large.txt")
    assert "emulate_vram_gib" in _changes("torch_1_12_allowed.txt")
    assert "kv_precision: int8" in _changes("torch_1_8_reserved.txt")
    assert "lowvram doctor --model" in _changes("lowvram_plan.txt")


def test_unrelated_text_is_not_an_oom():
    assert parse_oom_message("ValueError: shapes do not match") is None
    with pytest.raises(ConfigError, match="no out-of-memory message"):
        read_oom_input(b"hello world", "notes.txt")


# ---------------------------------------------------------------- crash reports


def test_crash_report_round_trip(tmp_path, tiny_qwen2_dir):
    from lowvram.config import load_profile

    events = [{"step": 120, "action": "kv_precision", "to": "int8"}, {"step": 180, "action": "spill", "pages": 64}]
    memory = {"weight_bytes": 123_456, "kv_pool_bytes": 65_536, "device_name": "NVIDIA GeForce GTX 1650"}
    path = write_crash_report(
        tmp_path / "r.json",
        profile=load_profile("4gb"),
        model=tiny_qwen2_dir,
        memory=memory,
        controller_events=events,
        exception_text="boom",
        command="lowvram x",
    )
    report = read_crash_report(path)
    assert report.exception_text == "boom" and report.command == "lowvram x"
    assert report.profile["name"] == "4gb" and report.profile["max_model_len"] == 16384
    assert report.model["path"] == str(tiny_qwen2_dir)
    assert report.model["config"]["architectures"] == ["Qwen2ForCausalLM"]
    assert report.memory == memory and report.controller_events == events
    assert report.created_utc.endswith("Z") and report.lowvram_version


def test_crash_reports_go_to_the_user_data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert default_crash_report_dir() == tmp_path / "data" / "lowvram" / "crash-reports"
    path = write_crash_report(None, profile="cpu", model={}, memory={}, exception_text="x")
    assert path.parent == default_crash_report_dir() and path.name.startswith("crash-")
    inside = write_crash_report(tmp_path, profile=None, model=None, memory={}, exception_text="y")
    assert inside.parent == tmp_path and read_crash_report(inside).exception_text == "y"


def test_a_file_that_is_not_a_crash_report_is_refused(tmp_path):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ConfigError, match="not a lowvram crash report"):
        read_crash_report(other)
    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps({"format": "lowvram-crash-report", "version": 99}))
    with pytest.raises(ConfigError, match="update lowvram"):
        read_crash_report(newer)


def test_a_cuda_oom_becomes_a_crash_report_and_a_doctor_command(tmp_path, monkeypatch, capsys, tiny_llama_dir):
    import argparse

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    message = (CORPUS / "torch_2_4_other_process_wrapped.txt").read_text().split(": ", 1)[1]

    @report_cuda_oom
    def command(args):
        raise torch.cuda.OutOfMemoryError(message)

    code = command(argparse.Namespace(profile="4gb", model=str(tiny_llama_dir), max_model_len=2048))
    err = capsys.readouterr().err
    assert code == EXIT_OUT_OF_MEMORY
    path = Path(err.strip().splitlines()[0].rsplit(" ", 1)[1])
    assert f"lowvram doctor --oom {path}" in err
    report = read_crash_report(path)
    assert "Tried to allocate 256.00 MiB" in report.exception_text
    assert report.profile["name"] == "4gb" and report.profile["max_model_len"] == 2048
    assert report.model["config"]["architectures"] == ["LlamaForCausalLM"]

    code = _run_doctor(["--oom", str(path)])
    out = capsys.readouterr().out
    assert code == 0
    assert "lowvram crash report" in out and "Other processes held 1.20 GiB" in out
    assert "memory plan" in out  # the profile and model in the report are planned again


def test_format_doctor_hint_quotes_the_path():
    hint = format_doctor_hint("/tmp/my reports/crash-1.json")
    assert hint.splitlines()[-1].strip() == "lowvram doctor --oom '/tmp/my reports/crash-1.json'"


def test_is_cuda_oom():
    assert is_cuda_oom(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB"))
    assert is_cuda_oom(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    assert not is_cuda_oom(ValueError("out of memory"))
    assert not is_cuda_oom(RuntimeError("shape mismatch"))


# ---------------------------------------------------------------- memory snapshots


def _frame(filename, line, name):
    return {"filename": filename, "line": line, "name": name}


def _snapshot(with_history=False):
    """A torch 2.1+ snapshot (frames per block, innermost first); torch 2.0 kept them in 'history'."""

    def block(size, frames, state="active_allocated"):
        entry = {"address": 0, "size": size, "requested_size": size, "state": state}
        if with_history:
            entry["history"] = [{"addr": 0, "real_size": size, "frames": frames}]
        else:
            entry["frames"] = frames
        return entry

    torch_frame = _frame("/usr/lib/python3/site-packages/torch/nn/modules/module.py", 1750, "_call_impl")
    kv = [
        _frame("/src/lowvram/kv_quant.py", 170, "allocate_pages"),
        _frame("/src/lowvram/model_runner.py", 24, "__init__"),
    ]
    weights = [_frame("/src/lowvram/loader.py", 120, "load_weights")]
    scores = [
        torch_frame,
        _frame("/src/kernels/paged_attention.py", 90, "_attend"),
        _frame("/src/lowvram/model.py", 80, "forward"),
    ]
    segments = [
        {
            "total_size": 600 * MIB,
            "allocated_size": 600 * MIB,
            "blocks": [block(14 * MIB, kv) for _ in range(40)] + [block(40 * MIB, weights)],
        },
        {
            "total_size": 400 * MIB,
            "allocated_size": 256 * MIB,
            "blocks": [block(256 * MIB, scores), block(144 * MIB, [], state="inactive")],
        },
    ]
    return {"segments": segments, "device_traces": []}


@pytest.mark.parametrize("with_history", [False, True], ids=["torch2.1+", "torch2.0"])
def test_snapshot_summary_names_what_held_the_memory(with_history):
    evidence = read_oom_input(pickle.dumps(_snapshot(with_history)), "snapshot.pickle")
    summary = evidence.snapshot
    assert summary.reserved_bytes == 1000 * MIB and summary.allocated_bytes == 856 * MIB
    assert summary.largest_free_bytes == 144 * MIB
    assert summary.categories == {"KV pages": 560 * MIB, "attention workspace": 256 * MIB, "weights": 40 * MIB}
    top = summary.sites[0]
    assert top.where == "kv_quant.py:170 in allocate_pages" and top.num_blocks == 40
    # torch's own frames are skipped: the site is the lowvram function that asked
    assert summary.sites[1].where == "paged_attention.py:90 in _attend"
    from lowvram.memory.oom import explain_snapshot

    changes = " ".join(f.change for f in explain_snapshot(summary))
    assert "kv_precision: int8" in changes and "expandable_segments" in changes


def test_a_hostile_pickle_is_refused():
    class Evil:
        def __reduce__(self):
            return (print, ("this must never run",))

    with pytest.raises(ConfigError, match="could not be read"):
        read_oom_input(pickle.dumps(Evil()), "evil.pickle")


# ---------------------------------------------------------------- the command


def read_crash_report(path):
    return crash_report_from_dict(json.loads(Path(path).read_text()), f"crash report {str(path)!r}")


def _run_doctor(argv):
    from lowvram import cli

    return cli.main(["doctor", *argv])


def test_doctor_oom_explains_a_message_file(capsys):
    code = _run_doctor(["--oom", str(CORPUS / "torch_2_8_fragmented.txt")])
    out = capsys.readouterr().out
    assert code == 0 and "out-of-memory message" in out and "expandable_segments:True" in out


def test_doctor_oom_reads_stdin_and_prints_json(monkeypatch, capsys):
    data = (CORPUS / "torch_1_8_reserved.txt").read_bytes()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    code = _run_doctor(["--oom", "-", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["kind"] == "message"
    assert result["facts"]["requested_bytes"] == 64 * MIB and result["findings"]


def test_doctor_oom_missing_file_is_a_clean_error(tmp_path, capsys):
    code = _run_doctor(["--oom", str(tmp_path / "missing.txt")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("lowvram: error: --oom") and "no such file" in err


def test_doctor_oom_explains_a_snapshot_file(tmp_path, capsys):
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(_snapshot()))
    code = _run_doctor(["--oom", str(path)])
    out = capsys.readouterr().out
    assert code == 0 and "torch memory snapshot" in out and "allocate_pages" in out
