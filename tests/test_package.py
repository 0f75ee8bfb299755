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
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return next(out.glob("lowvram-*.whl"))


def test_wheel_installs_only_the_lowvram_namespace(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"lowvram"}
    for expected in (
        "lowvram/kernels/__init__.py",
        "lowvram/tui/__init__.py",
        "lowvram/profiles/4gb.yaml",
        "lowvram/cli.py",
        "lowvram/demo/tasks.py",
        "lowvram/demo_model/model.safetensors",
        "lowvram/demo_model/tokenizer.json",
        "lowvram/demo_model/chat_template.jinja",
    ):
        assert expected in names
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "lowvram = lowvram.cli:main" in entry_points


def test_installed_names_import(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    code = (
        "import importlib.util, lowvram, lowvram.kernels, lowvram.tui\n"
        "from lowvram.config import load_profile\n"
        f"assert lowvram.__file__.startswith({str(target)!r}), lowvram.__file__\n"
        f"assert lowvram.kernels.__file__.startswith({str(target)!r})\n"
        "assert load_profile('4gb').name == '4gb'\n"
        "from lowvram.models.loader import resolve_model_path\n"
        f"assert str(resolve_model_path(None)).startswith({str(target)!r})\n"
        "assert importlib.util.find_spec('tui') is None\n"
        "spec = importlib.util.find_spec('kernels')  # Hugging Face's, where transformers brought it\n"
        f"assert spec is None or not spec.origin.startswith({str(target)!r}), spec.origin\n"
        "print('ok')\n"
    )
    # Run from an empty directory so the source tree is not on sys.path.
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={"PYTHONPATH": str(target), "PATH": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.stdout.strip() == "ok", result.stderr


# Run from the checkout's root, as `python -m pytest` and `python -m lowvram` are: the root is
# then on sys.path, and the repository's kernels/ folder must not stand in for Hugging Face's
# `kernels` package, which transformers (5.25 on) depends on and imports while loading a model.
CHECKOUT_ROOT_SCRIPT = """
import importlib.metadata, importlib.util, os, sys
root = os.path.realpath(sys.argv[1])
assert os.path.realpath(sys.path[0] or os.curdir) == root, sys.path[:2]
import kernels
where = getattr(kernels, "__file__", None)
if where is None:  # no other kernels installed: an empty namespace module, as for a folder
    assert kernels.__path__ == [] and not [n for n in vars(kernels) if not n.startswith("__")], vars(kernels)
    try:
        import kernels.rms_norm
    except ImportError:
        pass
    else:
        raise AssertionError("kernels.rms_norm imported from the checkout")
else:
    assert not os.path.realpath(where).startswith(root + os.sep), where
    importlib.metadata.version("kernels")  # the installed distribution's module, not a folder of ours
from transformers.utils import import_utils
getattr(import_utils, "is_kernels_available", bool)()  # 5.13-5.24 import the module found here
if importlib.util.find_spec("transformers.integrations.hub_kernels") is not None:
    import transformers.integrations.hub_kernels  # what failed: `from kernels import CUDAProperties`
from transformers import AutoModelForCausalLM
AutoModelForCausalLM.from_pretrained(sys.argv[2])
from lowvram import LLM, SamplingParams
out = LLM(model=sys.argv[2], profile="cpu").generate(["hello"], SamplingParams(temperature=0, max_tokens=2))
assert len(out[0].outputs[0].token_ids) == 2
import lowvram.kernels.rms_norm
print("kernels:", where)
"""


def test_the_checkout_root_does_not_shadow_hugging_faces_kernels(tiny_llama_dir):
    result = subprocess.run(
        [sys.executable, "-c", CHECKOUT_ROOT_SCRIPT, str(ROOT), str(tiny_llama_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("kernels:"), result.stdout


def test_python_m_lowvram_runs_from_the_checkout_root():
    result = subprocess.run(
        [sys.executable, "-m", "lowvram", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "usage: lowvram" in result.stdout


def test_the_oldest_set_pins_every_lower_bound():
    """.ci/oldest.txt, which `.ci/run --oldest` tests, holds each dependency at the lower bound
    pyproject.toml gives it: a bound raised or lowered in one place and not the other fails."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    lower_bounds = {}
    for line in requires("lowvram"):
        requirement = Requirement(line)
        if (
            requirement.marker is not None
            and requirement.marker.evaluate({"extra": "um"})
            and not requirement.marker.evaluate({"extra": ""})
        ):
            continue  # cuda-bindings: only GPU machines install it
        (bound,) = [spec for spec in requirement.specifier if spec.operator == ">="]
        lower_bounds[canonicalize_name(requirement.name)] = bound.version
    pins = {}
    for line in (ROOT / ".ci" / "oldest.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version.strip()
    assert pins == lower_bounds
