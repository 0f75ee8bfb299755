import math
import re
import subprocess
from datetime import datetime
from pathlib import Path

import pytest
import torch

from lowvram.bench import record as bench_record
from lowvram.bench.record import git_commit, measure_copy_bandwidth_gbps, run_metadata

ROOT = Path(__file__).resolve().parents[1]


def test_git_commit_is_the_checkout_head():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    assert git_commit() == head
    assert re.fullmatch(r"[0-9a-f]{40}", git_commit())
    assert head.startswith(git_commit(short=True)) and len(git_commit(short=True)) < 40


def test_git_commit_is_unknown_without_git(monkeypatch):
    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(bench_record.subprocess, "run", no_git)
    assert git_commit() == "unknown"


def test_the_copy_bandwidth_is_a_finite_positive_rate():
    gbps = measure_copy_bandwidth_gbps(8 * 2**20, "cpu", num_repeats=3)
    assert math.isfinite(gbps) and gbps > 0


def test_metadata_names_the_command_date_and_versions():
    meta = run_metadata("lowvram bench speed --shape tiny")
    assert meta["command"] == "lowvram bench speed --shape tiny"
    assert meta["versions"]["torch"] == torch.__version__
    assert meta["gpu"] == (torch.cuda.get_device_name() if torch.cuda.is_available() else None)
    assert datetime.fromisoformat(meta["date"]).utcoffset().total_seconds() == 0
