"""Benchmark and tool scripts under scripts/ (and the experiments in scripts/lab/), loaded as
modules for the tests that drive them."""

import importlib.util
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str):
    """scripts/<name>.py (or scripts/lab/<name>.py) as the module `name`, registered in sys.modules (dataclasses look
    their module up while a class is built)."""
    path = SCRIPTS / f"{name}.py"
    if not path.is_file():
        path = SCRIPTS / "lab" / f"{name}.py"
    if str(path.parent) not in sys.path:  # its siblings import by name, as when it runs directly
        sys.path.append(str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
