#!/usr/bin/env bash
# Every GPU test under an emulated 4 GB card, then the key benchmarks, in one call.
# Usage: scripts/test_gpu.sh [RESULTS_DIR]   (default: $OUT if set, else docs/bench/raw)
# Exit status: non-zero if any GPU test failed.
set -uo pipefail
cd "$(dirname "$0")/.."
results=${1:-${OUT:-docs/bench/raw}}
mkdir -p "$results"
export PYTHONUNBUFFERED=1 LOWVRAM_TEST_EMULATE_GIB=4
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || python3 -m pip install --no-deps --no-build-isolation -e .
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader | tee "$results/gpu.txt"

python3 -m pytest -m gpu -q -rs -s tests 2>&1 | tee "$results/gpu_tests.log"
status=${PIPESTATUS[0]}

for bench in scripts/bench_*.py; do
    name=$(basename "$bench" .py)
    echo "== $name"
    timeout 300 python3 "$bench" --json "$results/$name.json" 2>&1 | tail -40
done
echo "GPU tests exit status: $status"
exit "$status"
