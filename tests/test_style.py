"""The tree is ruff-clean: lint and format, as configured in pyproject.toml (seconds)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def ruff(*args: str) -> subprocess.CompletedProcess:
    # the ruff installed beside this interpreter (the dev extras), not whichever is on PATH
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "args", [("check", "--no-cache", "."), ("format", "--no-cache", "--check", ".")], ids=["lint", "format"]
)
def test_ruff_is_clean(args):
    result = ruff(*args)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
