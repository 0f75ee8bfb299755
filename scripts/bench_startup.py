"""How long the command line takes to start: `lowvram --help`, and `lowvram generate` on the
bundled demo model (load, a 16-token answer, exit), wall time of fresh processes, median of runs.

    python scripts/bench_startup.py --runs 5 --json startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone

COMMANDS = {
    "help": ["--help"],
    "generate_demo": ["generate", "-p", "What is 17 + 25?", "-n", "16", "--device", "cpu"],
}


def wall_s(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "lowvram", *args], check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    record = {
        "command": " ".join(["scripts/bench_startup.py", *sys.argv[1:]]),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
    }
    for name, command in COMMANDS.items():
        wall_s(command)  # warm the file cache
        times = [wall_s(command) for _ in range(args.runs)]
        record[name] = {"median_s": round(statistics.median(times), 3), "runs_s": [round(t, 3) for t in times]}
        print(f"lowvram {' '.join(command)}: median {record[name]['median_s']:.2f} s over {args.runs} runs")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(record, file, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
