#!/usr/bin/env bash
# Every GPU test under an emulated 4 GB card, then the key benchmarks, in one call.
#
#   scripts/test_gpu.sh [all|tests|benches] [bench names...]
#
# Results (logs, JSON, plots) go to docs/bench/raw; when $OUT is set (the GPU
# runner's output folder, which takes few files) they are packed into $OUT/results.tgz.
# The whole call ends within DEADLINE_S seconds (default 570): a benchmark that would
# run past it gets the time left, or is skipped when under 30 s remain. Benchmarks: w4a16 quantize doctor_accuracy prefix_cache
# paged_attention paged_attention_window paged_attention_floor paged_attention_sweep paged_attention_sms16 paged_attention_floor_sms16 kv_pool gemv_sweep gemv_rows_sweep gemv_tune gemv_tune_compensated gemv_tune_multi gemv_floor profile_decode profile_decode_plain stress stress_invariant streaming_7b deepseek_v2 speed speed_profile speed_unpipelined speed_sampled speed_sampled_unpipelined speed_rank8 speed_plain speed_plain_lanes speed_plain_head_tuned speed_plain_tuned speed_plain_head_multi speed_plain_multi speed_tuned speed_plain_nopdl speed_plain_head_nopdl speed_plain_head speed_prefill_graphs speed_invariant speed_head
# (speed_unpipelined: the speed bench with each decode step run alone; speed_sampled[_unpipelined]: the same with
# requests sampled at temperature 1.0, as the server's default; speed_plain: the 1.5B shape quantized as a
# published AutoAWQ checkpoint is, every linear INT4, no compensation; speed_plain_lanes: the same with the
# one-row lane GEMV instead of the K-in-thread form (LOWVRAM_GEMV_FORM=lanes); speed_plain_head: the same with an INT4 lm_head;
# *_multi: with the 2-16-row configurations gemv_tune_multi measured; *_nopdl: with LOWVRAM_PDL=0; speed_rank8: the profile's FP16 layers with rank-8 compensation instead of 16; *_tuned: with the one-row
# configurations gemv_tune measured, at batch 1 and 8; GPU_TEST_FILES: run the GPU tests of these files only;
# TESTS_TIMEOUT_S: the tests' time limit, default 330 s: the whole suite took 235-290 s on H200 machines)
# (default: the first six, in that order). Exit status: non-zero if a GPU test failed.
# One call may run 10 minutes, so the newer benchmarks are asked for by name, e.g.
#   scripts/test_gpu.sh benches profile_decode speed streaming_7b
#   scripts/test_gpu.sh benches kv_pool deepseek_v2
#   scripts/test_gpu.sh benches stress
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
shift || true
benches=${*:-w4a16 quantize doctor_accuracy prefix_cache paged_attention kv_pool}
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
    [[ " $benches " == *" $name "* ]] || return 0
    local left=$((deadline - SECONDS))
    if (( left < 30 )); then echo "== bench $name skipped: ${left}s left of ${deadline}s"; return 0; fi
    (( limit > left )) && limit=$left
    echo "== bench $name (limit ${limit}s)"
    timeout "$limit" "$@" --json "$results/bench_$name.json" > "$results/bench_$name.log" 2>&1
    echo "exit $?"
    tail -25 "$results/bench_$name.log"
}
if [ "$what" != tests ]; then
    run_bench w4a16 90 python3 scripts/bench_w4a16.py
    run_bench quantize 150 python3 scripts/bench_quantize.py --num-samples 32
    run_bench doctor_accuracy 150 python3 scripts/bench_doctor_accuracy.py --contexts 1024,4096,8192 --batches 1,4 --max-seconds 100
    run_bench prefix_cache 120 python3 scripts/bench_prefix_cache.py --shape r1-distill-qwen-1.5b --device cuda --turns 10 --padding-tokens 1000 --restore-tokens 8192
    run_bench paged_attention 150 python3 scripts/bench_paged_attention.py --kernel-times
    # Compressed pages with the FP16 window the controller keeps (kv_recent_fp16_tokens: 64).
    run_bench paged_attention_window 150 python3 scripts/bench_paged_attention.py --precisions int8,int4 --window-tokens 64
    # Beside each split row, a copy of its bytes followed by its merge: the split design's bound.
    run_bench paged_attention_floor 150 python3 scripts/bench_paged_attention.py --floor
    run_bench paged_attention_sweep 300 python3 scripts/bench_paged_attention.py --sweep
    # On a slice of 16 SMs (a green context), the SM count of an RTX 3050 laptop GPU.
    run_bench paged_attention_sms16 150 python3 scripts/bench_paged_attention.py --sms 16 --kernel-times
    # The split design's bound on those 16 SMs.
    run_bench paged_attention_floor_sms16 150 python3 scripts/bench_paged_attention.py --sms 16 --floor
    run_bench kv_pool 300 python3 scripts/bench_kv_pool.py
    # The um pool to 128K with spill: its chunked prefill reads the spilled context over the bus, ~3-4 minutes.
    run_bench kv_pool_128k 480 python3 scripts/bench_kv_pool.py --runs um,device-int8 --max-prefill-s 330 --transfer-mib 0
    # The one-row INT4 kernel's tile sizes, splits and dequantization forms on the 1.5B shape's projections.
    run_bench gemv_sweep 240 python3 scripts/profile_decode.py --sweep-gemv-only --sweep-rows 1 ${GEMV_SWEEP_ARGS:-}
    # The floor under the GEMV's tilings: reading the packed words alone.
    # The K-in-thread form against the lane kernel's default, without compensation (plain AWQ layers).
    run_bench gemv_rows_sweep 240 python3 scripts/profile_decode.py --sweep-gemv-only --sweep-rows 1 --rank 0 --sweep-forms rows
    # The GPU's own one-row configurations for gate/up and an INT4 head, without and with the
    # compensation, written to the tuning file the *_tuned speed runs read (LOWVRAM_GEMV_TUNING).
    run_bench gemv_tune 150 python3 scripts/profile_decode.py --sweep-gemv-only --sweep-rows 1 --rank 0 --sweep-shapes gate_up,head --sweep-forms rows --save-tuning "$results/gemv_tuning.json"
    run_bench gemv_tune_compensated 80 python3 scripts/profile_decode.py --sweep-gemv-only --sweep-rows 1 --rank 16 --sweep-shapes gate_up --sweep-forms rows --save-tuning "$results/gemv_tuning.json"
    # The GPU's own 2-16-row configurations of the interleaving kernel (batch 2-16 decode), the
    # head first, written to a tuning file that starts from the shipped one-row entries.
    [[ " $benches " == *" gemv_tune_multi "* ]] && rm -f "$results/gemv_tuning_multi.json"
    run_bench gemv_tune_multi 200 python3 scripts/profile_decode.py --sweep-gemv-only --sweep-rows 8 --rank 0 --sweep-shapes head,gate_up,down,qkv,o --sweep-forms interleave --save-tuning "$results/gemv_tuning_multi.json"
    run_bench gemv_floor 120 python3 scripts/probe_gemv_floor.py
    run_bench profile_decode 240 python3 scripts/profile_decode.py --quantize --emulate-vram-gib 4 --context 512 --batch-sizes 1,8 ${PROFILE_DECODE_ARGS:---sweep-gemv --host-profile}
    # Kernel timeline of a graph-replayed batch-1 step on the plain AutoAWQ-style checkpoint (no compensation).
    run_bench profile_decode_plain 200 python3 scripts/profile_decode.py --quantize --emulate-vram-gib 4 --context 512 --batch-sizes 1 --rank 0 --fp16-budget-mib 0
    run_bench stress 580 python3 scripts/stress_engine.py --shape r1-distill-qwen-1.5b --quantize --profile 4gb --emulate-vram-gib 4 --num-requests 64 --max-prompt-tokens 16384 --max-output-tokens 64 --seed 6 --long-share 0.25 --modes off,on,latency --check-alone 4 --plot "$results/stress_16k.png" --summary-md "$results/stress_16k.md"
    # Batch-invariant mode, controller on: every request checked against its run alone.
    run_bench stress_invariant 400 python3 scripts/stress_engine.py --shape r1-distill-qwen-1.5b --quantize --profile 4gb --emulate-vram-gib 4 --num-requests 64 --max-prompt-tokens 16384 --max-output-tokens 64 --seed 6 --long-share 0.25 --modes on --check-alone 64 --batch-invariant --summary-md "$results/stress_invariant.md"
    run_bench streaming_7b 240 python3 scripts/bench_7b_streaming.py
    run_bench deepseek_v2 300 python3 scripts/bench_deepseek_v2.py --model-dir /tmp/dsv2-lite-awq --profile 4gb --emulate-vram-gib 4
    run_bench speed 420 lowvram bench speed --cuda-graphs --shape r1-distill-qwen-1.5b --quantize --profile 4gb --emulate-vram-gib 4 --vs-hf --output "$results/bench_speed.md" --plot "$results/bench_speed.png"
    # The speed bench without transformers' generate beside it (the default run's --vs-hf takes minutes).
    run_bench speed_profile 240 lowvram bench speed --cuda-graphs --shape r1-distill-qwen-1.5b --quantize --profile 4gb --emulate-vram-gib 4 --output "$results/bench_speed_profile.md"
    run_bench speed_unpipelined 240 lowvram bench speed --cuda-graphs --no-pipelined-decode --shape r1-distill-qwen-1.5b --quantize --profile 4gb --emulate-vram-gib 4 --output "$results/bench_speed_unpipelined.md"
    run_bench speed_sampled 240 lowvram bench speed --cuda-graphs --temperature 1.0 --shape r1-distill-qwen-1.5b --quantize --profile 4gb --emulate-vram-gib 4 --output "$results/bench_speed_sampled.md"
    run_bench speed_sampled_unpipelined 240 lowvram bench speed --cuda-graphs --no-pipelined-decode --temperature 1.0 --shape r1-distill-qwen-1.5b --quantize --profile 4gb --emulate-vram-gib 4 --output "$results/bench_speed_sampled_unpipelined.md"
    run_bench speed_rank8 240 lowvram bench speed --cuda-graphs --shape r1-distill-qwen-1.5b --quantize --rank 8 --profile 4gb --emulate-vram-gib 4 --output "$results/bench_speed_rank8.md"
    run_bench speed_plain 240 lowvram bench speed --cuda-graphs --shape r1-distill-qwen-1.5b --quantize --fp16-budget-mib 0 --rank 0 --profile 4gb --emulate-vram-gib 4 --output "$results/bench_speed_plain.md"
    run_bench speed_plain_lanes 240 env LOWVRAM_GEMV_FORM=lanes lowvram bench speed --cuda-graphs --shape r1-distill-qwen-1.5b --quantize --fp16-budget-mib 0 --rank 0 --profile 4gb --emulate-vram-gib 4 --output "$results/bench_speed_plain_lanes.md"
    run_bench speed_plain_head_tuned 150 env LOWVRAM_GEMV_TUNING="$results/gemv_tuning.json" lowvram bench speed --cuda-graphs --batch-sizes 1,8 --shape r1-distill-qwen-1.5b --quantize --fp16-budget-mib 0 --rank 0 --quantize-head --calib-samples 2 --profile 4gb --emulate-vram-gib 4 --output "$results/bench_speed_plain_head_tuned.md"
    run_bench speed_plain_tuned 90 env LOWVRAM_GEMV_TUNING="$results/gemv_tuning.json" lowvram bench speed --cuda-graphs --batch-sizes 1,8 --shape r1-distill-qwen-1.5b --quantize --fp16-budget-mib 0 --rank 0 --profile 4gb --emulate-vram-gib 4 --output "$results/bench_speed_plain_tuned.md"
    run_bench speed_plain_head_multi 120 env LOWVRAM_GEMV_TUNING="$results/gemv_tuning_multi.json" lowvram bench speed --cuda-graphs --batch-sizes 1,8 --shape r1-distill-qwen-1.5b --quantize --fp16-budget-mib 0 --rank 0 --quantize-head --calib-samples 2 --profile 4gb --emulate-vram-gib 4 --output "$results/bench_speed_plain_head_multi.md"
    run_bench speed_plain_multi 80 env LOWVRAM_GEMV_TUNING="$results/gemv_tuning_multi.json" lowvram bench speed --cuda-graphs --batch-sizes 1,8 --shape r1-distill-qwen-1.5b --quantize --fp16-budget-mib 0 --rank 0 --profile 4gb --emulate-vram-gib 4 --output "$results/bench_speed_plain_multi.md"
    run_bench speed_tuned 90 env LOWVRAM_GEMV_TUNING="$results/gemv_tuning.json" lowvram bench speed --cuda-graphs --batch-sizes 1,8 --shape r1-distill-qwen-1.5b --quantize --profile 4gb --emulate-vram-gib 4 --output "$results/bench_speed_tuned.md"
    # The same two without programmatic dependent launch (kernels/pdl.py), for a side-by-side on one host.
    run_bench speed_plain_nopdl 150 env LOWVRAM_PDL=0 lowvram bench speed --cuda-graphs --shape r1-distill-qwen-1.5b --quantize --fp16-budget-mib 0 --rank 0 --profile 4gb --emulate-vram-gib 4 --output "$results/bench_speed_plain_nopdl.md"
    run_bench speed_plain_head_nopdl 150 env LOWVRAM_PDL=0 lowvram bench speed --cuda-graphs --shape r1-distill-qwen-1.5b --quantize --fp16-budget-mib 0 --rank 0 --quantize-head --calib-samples 2 --profile 4gb --emulate-vram-gib 4 --output "$results/bench_speed_plain_head_nopdl.md"
    run_bench speed_plain_head 240 lowvram bench speed --cuda-graphs --shape r1-distill-qwen-1.5b --quantize --fp16-budget-mib 0 --rank 0 --quantize-head --calib-samples 2 --profile 4gb --emulate-vram-gib 4 --output "$results/bench_speed_plain_head.md"
    # Prefill graphs (off by default until this shows them faster) and an INT4 lm_head.
    run_bench speed_prefill_graphs 120 lowvram bench speed --cuda-graphs --prefill-graphs --shape r1-distill-qwen-1.5b --quantize --profile 4gb --emulate-vram-gib 4 --output "$results/bench_speed_prefill_graphs.md"
    run_bench speed_invariant 120 lowvram bench speed --cuda-graphs --batch-invariant --shape r1-distill-qwen-1.5b --quantize --profile 4gb --emulate-vram-gib 4 --output "$results/bench_speed_invariant.md"
    run_bench speed_head 150 lowvram bench speed --cuda-graphs --shape r1-distill-qwen-1.5b --quantize --quantize-head --calib-samples 2 --profile 4gb --emulate-vram-gib 4 --output "$results/bench_speed_head.md"
fi
exit "$status"
