#!/usr/bin/env bash
# Every GPU test under an emulated 4 GB card, then the key benchmarks, in one call.
# Usage: scripts/test_gpu.sh [RESULTS_DIR]   (default: $OUT if set, else docs/bench/raw)
#   BENCHES="w4a16 paged_attention"   run only these scripts/bench_<name>.py (default: all)
#   BENCH_TIMEOUT_S=240                per-benchmark limit
# Exit status: non-zero if any GPU test failed.
set -uo pipefail
cd "$(dirname "$0")/.."
results=${1:-${OUT:-docs/bench/raw}}
mkdir -p "$results"
export PYTHONUNBUFFERED=1 LOWVRAM_TEST_EMULATE_GIB=4
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$results/install.log" 2>&1 || cat "$results/install.log"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader | tee "$results/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$results/gpu.txt"

# Only modules that hold GPU tests: the others may need packages the GPU image lacks.
gpu_files=$(grep -l -E "pytest\.mark\.gpu|pytestmark = pytest\.mark\.gpu" tests/test_*.py)
python3 -m pytest -m gpu -q -rs -s -p no:cacheprovider $gpu_files 2>&1 | tee "$results/gpu_tests.log"
status=${PIPESTATUS[0]}

for bench in scripts/bench_*.py; do
    name=$(basename "$bench" .py)
    name=${name#bench_}
    if [ -n "${BENCHES:-}" ] && ! [[ " $BENCHES " == *" $name "* ]]; then
        continue
    fi
    echo "== bench $name"
    timeout "${BENCH_TIMEOUT_S:-240}" python3 "$bench" --json "$results/bench_$name.json" 2>&1 | tail -40
done
echo "GPU tests exit status: $status"
exit "$status"
