"""The package installs as `lowvram` alone, with its kernels, UI and profiles inside it."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
                   check=True, capture_output=True, timeout=300)
    return next(out.glob("lowvram-*.whl"))


def test_wheel_installs_only_the_lowvram_namespace(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"lowvram"}
    for expected in ("lowvram/kernels/__init__.py", "lowvram/tui/__init__.py", "lowvram/profiles/4gb.yaml", "lowvram/cli.py",
                     "lowvram/demo/tasks.py", "lowvram/demo_model/model.safetensors", "lowvram/demo_model/tokenizer.json",
                     "lowvram/demo_model/chat_template.jinja"):
        assert expected in names
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "lowvram = lowvram.cli:main" in entry_points


def test_installed_names_import(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    code = (
        "import importlib.util, lowvram, lowvram.kernels, lowvram.tui\n"
        "from lowvram.config import load_profile\n"
        f"assert lowvram.__file__.startswith({str(target)!r}), lowvram.__file__\n"
        f"assert lowvram.kernels.__file__.startswith({str(target)!r})\n"
        "assert load_profile('4gb').name == '4gb'\n"
        "from lowvram.loader import resolve_model_path\n"
        f"assert str(resolve_model_path(None)).startswith({str(target)!r})\n"
        "assert importlib.util.find_spec('kernels') is None and importlib.util.find_spec('tui') is None\n"
        "print('ok')\n"
    )
    # Run from an empty directory so the source tree is not on sys.path.
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(target), "PATH": ""},
                            capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "ok", result.stderr
