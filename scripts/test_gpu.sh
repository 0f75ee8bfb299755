#!/usr/bin/env bash
# Every GPU test under an emulated 4 GB card, then the key benchmarks, in one call.
#
#   scripts/test_gpu.sh [all|tests|benches] [bench names...]
#
# Results (logs, JSON, plots) go to docs/bench/raw; when $OUT is set (the GPU runner's output
# folder, which takes few files) they are packed into $OUT/results.tgz. The whole call ends
# within DEADLINE_S seconds (default 570): a benchmark that would run past it gets the time
# left, or is skipped when under 30 s remain. GPU_TEST_FILES: run the GPU tests of these
# files only; TESTS_TIMEOUT_S: the tests' time limit (default 330 s). Exit status: non-zero
# if a GPU test failed.
#
# Benchmarks (default: the first five): quantize doctor_accuracy prefix_cache paged_attention
# kv_pool speed speed_plain stress streaming_7b deepseek_v2. One call may run 10 minutes, so
# the longer ones are asked for by name, e.g.
#   scripts/test_gpu.sh benches speed speed_plain
#   scripts/test_gpu.sh benches stress
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
shift || true
benches=${*:-quantize doctor_accuracy prefix_cache paged_attention kv_pool}
results=docs/bench/raw
deadline=${DEADLINE_S:-570}
mkdir -p "$results"
pack() {
    [ -n "${OUT:-}" ] && tar -czf "$OUT/results.tgz" -C "$results" . && echo "packed $(ls "$results" | wc -l) files"
}
trap pack EXIT
export PYTHONUNBUFFERED=1
# Benchmarks write and quantize each random shape once per call and share it (lowvram.models.shapes).
export LOWVRAM_BENCH_CACHE=${LOWVRAM_BENCH_CACHE:-/tmp/lowvram-bench-cache}
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$results/install.log" 2>&1 || cat "$results/install.log"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader | tee "$results/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$results/gpu.txt"

status=0
if [ "$what" != benches ]; then
    # Only modules that hold GPU tests: the others may need packages the GPU image lacks.
    gpu_files=${GPU_TEST_FILES:-$(grep -l -E "pytest\.mark\.gpu|pytestmark = pytest\.mark\.gpu" tests/test_*.py)}
    LOWVRAM_TEST_EMULATE_GIB=4 LOWVRAM_TEST_PRINT_FAILURES=1 timeout "${TESTS_TIMEOUT_S:-330}" python3 -m pytest -m gpu -q -rs -s -p no:cacheprovider \
        $gpu_files 2>&1 | tee "$results/gpu_tests.log" | grep -v -E "^(PASSED|\.)" | tail -60
    status=${PIPESTATUS[0]}
    echo "GPU tests exit status: $status"
fi

run_bench() {  # name, limit in seconds, command...
    local name=$1 limit=$2
    shift 2
    local left=$((deadline - SECONDS))
    if (( left < 30 )); then echo "== bench $name skipped: ${left}s left of ${deadline}s"; return 0; fi
    (( limit > left )) && limit=$left
    echo "== bench $name (limit ${limit}s)"
    timeout "$limit" "$@" --json "$results/bench_$name.json" > "$results/bench_$name.log" 2>&1
    echo "exit $?"
    tail -25 "$results/bench_$name.log"
}
if [ "$what" != tests ]; then
    run_bench quantize 150 python3 scripts/bench_quantize.py --num-samples 32
    run_bench doctor_accuracy 150 python3 scripts/bench_doctor_accuracy.py --contexts 1024,4096,8192 --batches 1,4 --max-seconds 100
    run_bench prefix_cache 120 python3 scripts/bench_prefix_cache.py --shape r1-distill-qwen-1.5b --device cuda --turns 10 --padding-tokens 1000 --restore-tokens 8192
    run_bench paged_attention 150 python3 scripts/bench_paged_attention.py
    run_bench kv_pool 300 python3 scripts/bench_kv_pool.py
    run_bench stress 580 python3 scripts/stress_engine.py --shape r1-distill-qwen-1.5b --quantize --profile 4gb --emulate-vram-gib 4 --num-requests 64 --max-prompt-tokens 16384 --max-output-tokens 64 --seed 6 --long-share 0.25 --modes off,on,latency --check-alone 4 --plot "$results/stress_16k.png" --summary-md "$results/stress_16k.md"
    run_bench streaming_7b 240 python3 scripts/bench_7b_streaming.py
    run_bench deepseek_v2 300 python3 scripts/bench_deepseek_v2.py --model-dir /tmp/dsv2-lite-awq --profile 4gb --emulate-vram-gib 4
    run_bench speed 300 lowvram bench speed --cuda-graphs --shape r1-distill-qwen-1.5b --quantize --profile 4gb --emulate-vram-gib 4 --output "$results/bench_speed.md"
    run_bench speed_plain 240 lowvram bench speed --cuda-graphs --shape r1-distill-qwen-1.5b --quantize --fp16-budget-mib 0 --rank 0 --profile 4gb --emulate-vram-gib 4 --output "$results/bench_speed_plain.md"
fi
exit "$status"
