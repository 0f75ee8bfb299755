"""scripts/bench_paged_attention.py's bookkeeping, which runs without a GPU."""

import pytest
import torch
from script_modules import load_script

from lowvram.kernels.kv_quant import allocate_pages
from lowvram.kernels.paged_attention import paged_decode_attention, paged_decode_attention_ref

DEVICE = "cpu"


def test_window_pages_and_bytes_follow_the_pool():
    """--window-tokens: a sequence's pages kept in FP16 are the KV pool's for its last N
    tokens (whole pages), and the bytes read count those tokens at FP16 size."""
    bench = load_script("bench_paged_attention")
    assert bench.window_pages(8192, 0) == 0
    assert bench.window_pages(8192, 64) == 4  # four whole pages
    assert bench.window_pages(8193, 64) == 5  # and the page holding the newest token
    assert bench.window_pages(40, 64) == 3  # never more than the sequence has
    per_token = {precision: bench._bytes_per_token(precision) for precision in ("fp16", "int8", "int4")}
    assert bench.kv_bytes_read("int8", 8192, 2, 0) == 2 * 8192 * per_token["int8"]
    assert bench.kv_bytes_read("int8", 8193, 1, 64) == 8128 * per_token["int8"] + 65 * per_token["fp16"]
    assert bench.kv_bytes_read("int4", 40, 1, 64) == 40 * per_token["fp16"]
    assert bench.kv_bytes_read("fp16", 8192, 1, 64) == 8192 * per_token["fp16"]


def test_pages_kept_in_fp16_are_what_decode_attention_reads():
    """keep_in_fp16 lays out the window as the KV pool does: decode attention (the kernel, run
    by the interpreter, and the reference) reads the FP16 copies of the kept pages."""
    bench = load_script("bench_paged_attention")
    generator = torch.Generator().manual_seed(3)
    pages = allocate_pages(6, bench.BLOCK_SIZE, bench.NUM_KV_HEADS, bench.HEAD_DIM, "int8", device=DEVICE)
    pages.k.random_(0, 256, generator=generator)
    pages.v.random_(0, 256, generator=generator)
    for scale in (pages.k_scale, pages.v_scale):
        scale.uniform_(0.005, 0.02, generator=generator)
    table = torch.tensor([[4, 0, 5]], dtype=torch.int32)
    bench.keep_in_fp16(pages, table[0, 1:], generator)
    assert pages.has_window and pages.window_row.tolist() == [0, -1, -1, -1, -1, 1]
    q = torch.randn(1, bench.NUM_HEADS, bench.HEAD_DIM, generator=generator)
    args = (q, pages, table, torch.tensor([40], dtype=torch.int32), bench.HEAD_DIM**-0.5)
    out = paged_decode_attention(*args)
    assert (out - paged_decode_attention_ref(*args)).abs().max() < 1e-4
    pages.window_v[1].add_(1.0)  # the last page's values, read from the window
    assert (paged_decode_attention(*args) - out).abs().min() > 0.01


def test_the_command_line_becomes_the_plan_run_takes():
    """parse_args hands run() its rows and options as values, not the strings typed."""
    bench = load_script("bench_paged_attention")
    args = bench.parse_args(
        [
            "--precisions",
            "int8,int4",
            "--contexts",
            "8192,131072",
            "--batches",
            "4",
            "--splits",
            "41,66",
            "--config",
            "64/2/3",
            "--sms",
            "16",
        ]
    )
    assert (args.precisions, args.contexts, args.batches) == (["int8", "int4"], [8192, 131072], [4])
    assert (args.splits, args.config, args.sms) == ((41, 66), (64, 2, 3), 16)
    defaults = bench.parse_args([])
    assert defaults.precisions == list(bench.PRECISIONS) and defaults.contexts == list(bench.CONTEXT_LENS)
    assert (defaults.splits, defaults.config, defaults.sms) == ((), None, None)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--precisions", "fp8"], "--precisions: fp8 not among fp16, int8, int4"),
        (["--contexts", "8k"], "--contexts, --batches and --splits take comma-separated integers"),
        (["--splits", "0"], "--splits takes partition counts of 1 or more, got 0"),
        (["--config", "64/2"], "--config takes TOKENS/WARPS/STAGES, e.g. 64/2/3; got '64/2'"),
        (["--window-tokens", "-1"], "--window-tokens must be 0 or more, got -1"),
    ],
)
def test_a_bad_command_line_is_named(argv, message, capsys):
    bench = load_script("bench_paged_attention")
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err
