"""Decode attention bandwidth on paged FP16/INT8/INT4 KV caches, against the GPU's copy bandwidth.

Decode attention reads every K/V byte of the context once, so the figure of
merit is achieved GB/s (bytes of pages plus scales read, over the median time of one call
replayed from a CUDA graph, as the decode step runs it, with pages cold in L2) as a fraction
of a plain device-to-device copy. One layer of the R1-Distill-Qwen-1.5B shape (12 query
heads, 2 KV heads, head_dim 128).

Beside the copy bandwidth of a large buffer, each row has that of a copy moving its own byte
count, timed the same way: at small sizes that copy is latency bound too, and it is the fairer
ceiling. --sweep also times a small grid of kernel configurations per row (tile tokens, warps,
pipeline stages) and reports the best; a few minutes, most of it compiling.

--precisions, --contexts and --batches (comma-separated) pick the rows. --window-tokens N
keeps each sequence's pages holding its last N tokens in FP16 beside INT8/INT4 codes, as the
KV pool does when the controller compresses (the profiles' kv_recent_fp16_tokens, 64): the
kernels then read those pages' FP16 copies instead of their codes. --splits N,M also times each
row's default configuration with the default partitioning forced to N, M, ... partitions
(those a sequence can use: at most one per tile), recorded as the row's `by_splits`.
--config TOKENS/WARPS/STAGES (e.g. 64/2/3) times every row with that tile in place of the
default configuration's. --sms N runs everything, the copies it is compared with
included, on a slice of N of the GPU's SMs (scripts/lab/sm_slice.py: a card of 16 SMs, say, as an RTX
3050 laptop GPU has), with the kernels sizing their grids for N SMs; the record notes how many
distinct SMs a probe kernel reached there.

    python scripts/bench_paged_attention.py [--sweep] [--precisions int8,int4] [--contexts 131072]
        [--batches 8] [--window-tokens 64] [--splits 41,66] [--config 64/2/3] [--sms 16] [--json results.json]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import math
import sys
import time
from pathlib import Path

import torch

from lowvram.bench.record import hold_stream, measure_copy_bandwidth_gbps, run_metadata
from lowvram.errors import ConfigError
from lowvram.kernels.kv_quant import BITS_BY_PRECISION, allocate_pages
from lowvram.kernels.paged_attention import DecodeConfig, decode_config, paged_decode_attention, plan_decode_partitions
from lowvram.kv.pool import recent_window_blocks

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 12, 2, 128, 16
CONTEXT_LENS = (8192, 32768, 131072)
BATCH_SIZES = (1, 4, 8)
PRECISIONS = ("fp16", "int8", "int4")
TARGET_FRACTION = 0.60
MAX_COPIES = 16  # calls per timed graph
REPLAYS = 20
# --sweep: 24 tile configurations per row; each is compiled once per precision, which is most
# of the time.
# Two warps split a tile's tokens in two, so its row reductions cross one warp boundary, not three;
# one warp holds the whole tile and needs no barrier for them.
SWEEP_BLOCK_N = (32, 64, 128)
SWEEP_NUM_WARPS = (1, 2, 4, 8)
SWEEP_NUM_STAGES = (2, 3)


def copy_bandwidth_gbs(num_bytes: int = 2 << 30) -> float:
    """Device-to-device copy: bytes read plus bytes written per second."""
    return measure_copy_bandwidth_gbps(num_bytes, "cuda")


def random_pages(precision: str, num_blocks: int, generator: torch.Generator):
    pages = allocate_pages(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, precision, device="cuda")
    if precision == "fp16":
        pages.k.normal_(generator=generator)
        pages.v.normal_(generator=generator)
        return pages
    for codes in (pages.k, pages.v):
        codes.random_(0, 256, generator=generator)
    for scale, zero in ((pages.k_scale, pages.k_zero), (pages.v_scale, pages.v_zero)):
        scale.uniform_(0.005, 0.02, generator=generator)
        zero.uniform_(0.0, 255.0 if precision == "int8" else 15.0, generator=generator)
    return pages


def synchronize() -> None:
    """Wait for the current stream, which runs all of the bench's work: under --sms a green
    context's stream, which the device-wide synchronize does not wait for."""
    torch.cuda.current_stream().synchronize()


def capture_graph(run_all) -> torch.cuda.CUDAGraph:
    """A CUDA graph of what `run_all` launches, captured on the current stream under --sms so that
    its kernels replay on the slice's SMs (torch's own capture stream is the whole GPU's), else on
    torch's (the default stream cannot be captured)."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.current_stream()
    with torch.cuda.graph(graph, stream=None if stream == torch.cuda.default_stream() else stream):
        run_all()
    return graph


def replay_time_ms(run_all, calls_per_graph: int) -> float:
    """Median time of one of the `calls_per_graph` calls `run_all` makes, replayed from a CUDA
    graph so Python's launch cost is not counted."""
    run_all()  # compiles the kernels (and makes any lasting buffer) outside the capture
    synchronize()
    graph = capture_graph(run_all)
    graph.replay()
    synchronize()
    times_ms = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        hold_stream()  # the graph's launch by the host is not the calls' time
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times_ms.append(start.elapsed_time(end) / calls_per_graph)
    del graph
    return sorted(times_ms)[len(times_ms) // 2]


def same_bytes_copy_gbs(num_bytes: int, copies: int) -> float:
    """Read plus written GB/s of device-to-device copies moving `num_bytes` in all (so reading
    half of it), over `copies` distinct buffers per graph like the attention calls."""
    sources = [torch.empty(num_bytes // 2, dtype=torch.uint8, device="cuda") for _ in range(copies)]
    targets = [torch.empty_like(source) for source in sources]

    def run_all():
        for source, target in zip(sources, targets):
            target.copy_(source)

    time_ms = replay_time_ms(run_all, copies)
    sources.clear()  # the buffers go; run_all keeps only the empty lists
    targets.clear()
    torch.cuda.empty_cache()
    return 2 * (num_bytes // 2) / (time_ms * 1e-3) / 1e9


@dataclasses.dataclass
class Setup:
    """Pages and inputs of one (precision, context, batch): `copies` sets of distinct pages,
    together at least four times the L2 cache, so each call reads its pages from device memory
    as a 28-layer model would."""

    precision: str
    context_len: int
    batch_size: int
    copies: int
    bytes_read: int
    pages: object
    tables: list
    context_lens: torch.Tensor
    q: torch.Tensor

    @classmethod
    def make(cls, precision: str, context_len: int, batch_size: int, window_tokens: int = 0) -> Setup:
        generator = torch.Generator(device="cuda").manual_seed(0)
        blocks_per_seq = math.ceil(context_len / BLOCK_SIZE)
        bytes_read = kv_bytes_read(precision, context_len, batch_size, window_tokens)
        copies = _copies(bytes_read)
        num_blocks = copies * batch_size * blocks_per_seq
        pages = random_pages(precision, num_blocks, generator)
        # Scattered blocks, as a long-running pool hands them out.
        order = torch.randperm(num_blocks, device="cuda", generator=generator).to(torch.int32)
        by_sequence = order.view(copies, batch_size, blocks_per_seq)
        tables = [t.contiguous() for t in by_sequence]  # [S, max_blocks] each
        if pages.is_quantized and (window_blocks := window_pages(context_len, window_tokens)):
            keep_in_fp16(pages, by_sequence[..., blocks_per_seq - window_blocks :].flatten(), generator)
        context_lens = torch.full((batch_size,), context_len, dtype=torch.int32, device="cuda")
        q = torch.randn(batch_size, NUM_HEADS, HEAD_DIM, device="cuda", dtype=torch.float16, generator=generator)
        return cls(precision, context_len, batch_size, copies, bytes_read, pages, tables, context_lens, q)

    def calls(self, config: DecodeConfig, num_splits: int | None = None):
        """A function making one decode-attention call over each set of pages; `num_splits`
        forces the partition count."""

        def run_all():
            for table in self.tables:
                paged_decode_attention(
                    self.q,
                    self.pages,
                    table,
                    self.context_lens,
                    HEAD_DIM**-0.5,
                    max_context_len=self.context_len,
                    num_splits=num_splits,
                    _config=config,
                )

        return run_all

    def time_us(self, config: DecodeConfig, num_splits: int | None = None) -> float:
        """Median time of one decode-attention call (kernel, and merge kernel when there is one)."""
        return replay_time_ms(self.calls(config, num_splits), self.copies) * 1e3


def _bytes_per_token(precision: str) -> int:
    """K and V bytes of one token in one layer, scales and zeros included."""
    per_head = {"fp16": 2 * HEAD_DIM, "int8": HEAD_DIM + 4, "int4": HEAD_DIM // 2 + 4}[precision]
    return 2 * NUM_KV_HEADS * per_head


def keep_in_fp16(pages, blocks: torch.Tensor, generator: torch.Generator) -> None:
    """Give quantized `pages` FP16 copies of `blocks` (random values), as the KV pool's window
    holds them: the kernels read those copies instead of the blocks' codes."""
    device = pages.k.device
    shape = (len(blocks), *pages.k.shape[1:3], pages.head_dim)
    pages.window_k = torch.randn(shape, device=device, dtype=torch.float16, generator=generator)
    pages.window_v = torch.randn(shape, device=device, dtype=torch.float16, generator=generator)
    pages.window_row = torch.full((pages.k.shape[0],), -1, dtype=torch.int32, device=device)
    pages.window_row[blocks.long()] = torch.arange(len(blocks), dtype=torch.int32, device=device)


def window_pages(context_len: int, window_tokens: int) -> int:
    """Pages of a sequence that the KV pool keeps in FP16 for its last `window_tokens` tokens
    (whole pages: the last ones of its block table)."""
    blocks = range(math.ceil(context_len / BLOCK_SIZE))
    return len(recent_window_blocks([(blocks, context_len)], window_tokens, BLOCK_SIZE))


def kv_bytes_read(precision: str, context_len: int, batch_size: int, window_tokens: int = 0) -> int:
    """Bytes one decode-attention call reads for its K/V: codes, scales and zeros of the tokens
    outside the FP16 window, FP16 values of those inside it (INT8/INT4 pages only)."""
    kept = 0
    if precision != "fp16":  # the tokens on the window's pages: from its first page to the end
        first_kept_page = math.ceil(context_len / BLOCK_SIZE) - window_pages(context_len, window_tokens)
        kept = context_len - first_kept_page * BLOCK_SIZE
    per_sequence = (context_len - kept) * _bytes_per_token(precision) + kept * _bytes_per_token("fp16")
    return batch_size * per_sequence


def _l2_bytes() -> int:
    return getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or 64 << 20


def _copies(bytes_per_call: int) -> int:
    return min(MAX_COPIES, max(1, math.ceil(4 * _l2_bytes() / bytes_per_call)))


def fits_in_memory(precision: str, context_len: int, batch_size: int, window_tokens: int = 0) -> bool:
    free_bytes, _ = torch.cuda.mem_get_info()
    per_call = batch_size * context_len * _bytes_per_token(precision)
    if precision != "fp16":  # the FP16 copies of the window's pages, beside their codes
        per_call += batch_size * window_pages(context_len, window_tokens) * BLOCK_SIZE * _bytes_per_token("fp16")
    return _copies(per_call) * per_call * 2 < free_bytes * 0.5


def sweep_configs() -> list[DecodeConfig]:
    """The tile grid."""
    return [
        DecodeConfig(block_n=block_n, num_warps=num_warps, num_stages=num_stages)
        for block_n, num_warps, num_stages in itertools.product(SWEEP_BLOCK_N, SWEEP_NUM_WARPS, SWEEP_NUM_STAGES)
    ]


def _config_label(config: DecodeConfig) -> str:
    return f"n{config.block_n}/w{config.num_warps}/s{config.num_stages}"


def _timed(setup: Setup, config: DecodeConfig, copy_gbs: float, num_splits: int | None = None) -> dict:
    time_us = setup.time_us(config, num_splits)
    achieved_gbs = setup.bytes_read / (time_us * 1e-6) / 1e9
    return {
        "time_us": round(time_us, 2),
        "achieved_gbs": round(achieved_gbs, 1),
        "fraction_of_copy": round(achieved_gbs / copy_gbs, 3),
    }


def bench_row(
    setup: Setup,
    copy_gbs: float,
    same_copy_gbs: float,
    sweep: bool,
    forced_splits: tuple[int, ...] = (),
    tile: tuple[int, int, int] | None = None,
) -> dict:
    """One row: the configuration paged_decode_attention takes for it (decode_config), or with
    `tile` (tokens, warps, stages) that one with the tile; with `sweep` every configuration of the
    grid, with `forced_splits` the row's configuration at each of those partition counts."""
    config = decode_config(
        setup.q.device,
        HEAD_DIM,
        BITS_BY_PRECISION[setup.precision],
        setup.batch_size,
        NUM_KV_HEADS,
        setup.context_len,
    )
    if tile is not None:
        block_n, num_warps, num_stages = tile
        config = DecodeConfig(block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    num_splits, partition_tokens = plan_decode_partitions(
        setup.batch_size, NUM_KV_HEADS, setup.context_len, setup.q.device, block_n=config.block_n
    )
    timed = _timed(setup, config, copy_gbs)
    row = {
        "precision": setup.precision,
        "context_len": setup.context_len,
        "batch_size": setup.batch_size,
        "num_splits": num_splits,
        "partition_tokens": partition_tokens,
        "time_us": timed["time_us"],
        "kv_bytes_read": setup.bytes_read,
        "achieved_gbs": timed["achieved_gbs"],
        "fraction_of_copy": timed["fraction_of_copy"],
        "calls_per_graph": setup.copies,
        "config": _config_label(config),
        "same_bytes_copy_gbs": round(same_copy_gbs, 1),
        "fraction_of_same_bytes_copy": round(timed["achieved_gbs"] / same_copy_gbs, 3),
    }
    if forced_splits:
        useful = math.ceil(setup.context_len / config.block_n)
        row["by_splits"] = [
            _sweep_result(setup, config, copy_gbs, n) for n in forced_splits if n != num_splits and n <= useful
        ]
    if sweep:
        results = [_sweep_result(setup, candidate, copy_gbs) for candidate in sweep_configs()]
        row["sweep"] = results
        timed_all = [result for result in results if "time_us" in result]
        if timed_all:
            best = min(timed_all, key=lambda result: result["time_us"])
            row["best"] = {**best, "fraction_of_same_bytes_copy": round(best["achieved_gbs"] / same_copy_gbs, 3)}
    return row


def _sweep_result(setup: Setup, config: DecodeConfig, copy_gbs: float, forced_splits: int | None = None) -> dict:
    num_splits, _ = plan_decode_partitions(
        setup.batch_size, NUM_KV_HEADS, setup.context_len, setup.q.device, forced_splits, block_n=config.block_n
    )
    try:
        result = _timed(setup, config, copy_gbs, forced_splits)
    except Exception as exc:  # a configuration that does not compile or fit is reported, not fatal
        result = {"error": f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"}
    label = _config_label(config)
    if forced_splits is not None:
        label += f"/{num_splits}splits"
    return {"config": label, **dataclasses.asdict(config), "num_splits": num_splits, **result}


def print_row(row: dict) -> None:
    line = (
        f"{row['precision']:>9} {row['context_len']:>7} {row['batch_size']:>5} "
        f"{row['num_splits']:>6} {row['time_us']:>8.1f} {row['achieved_gbs']:>7.0f} "
        f"{row['fraction_of_copy']:>7.1%} {row['same_bytes_copy_gbs']:>7.0f} {row['fraction_of_same_bytes_copy']:>7.1%}"
    )
    if "best" in row:
        best = row["best"]
        line += f"  best {best['config']:<32} {best['time_us']:>8.1f} {best['fraction_of_copy']:>7.1%}"
        fraction = best["fraction_of_copy"]
    else:
        fraction = row["fraction_of_copy"]
    if row["context_len"] >= 8192 and fraction < TARGET_FRACTION:
        line += "  below target"
    print(line, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked, with its lists parsed: precisions, contexts, batches and
    splits as lists of values, config as (tokens, warps, stages) or None."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    parser.add_argument(
        "--sweep", action="store_true", help="also time a grid of kernel configurations per row and report the best"
    )
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help="comma-separated page precisions")
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXT_LENS)), help="comma-separated context lengths")
    parser.add_argument("--batches", default=",".join(map(str, BATCH_SIZES)), help="comma-separated batch sizes")
    parser.add_argument(
        "--window-tokens",
        type=int,
        default=0,
        help="keep each sequence's last N tokens' pages in FP16 beside INT8/INT4 codes (default 0)",
    )
    parser.add_argument(
        "--config",
        default="",
        metavar="TOKENS/WARPS/STAGES",
        help="time every row with this tile instead of the default configuration",
    )
    parser.add_argument(
        "--splits", default="", help="comma-separated partition counts to also time each row's default configuration at"
    )
    parser.add_argument(
        "--sms",
        type=int,
        default=None,
        help="run on a slice of this many of the GPU's SMs (a green context; needs cuda-bindings)",
    )
    args = parser.parse_args(argv)
    if args.window_tokens < 0:
        parser.error(f"--window-tokens must be 0 or more, got {args.window_tokens}")
    args.precisions = args.precisions.split(",")
    if unknown := set(args.precisions) - set(PRECISIONS):
        parser.error(f"--precisions: {', '.join(sorted(unknown))} not among {', '.join(PRECISIONS)}")
    try:
        args.contexts = [int(n) for n in args.contexts.split(",")]
        args.batches = [int(n) for n in args.batches.split(",")]
        splits = tuple(int(n) for n in args.splits.split(",") if n)
    except ValueError as exc:
        parser.error(f"--contexts, --batches and --splits take comma-separated integers: {exc}")
    if any(n < 1 for n in splits):
        parser.error(f"--splits takes partition counts of 1 or more, got {args.splits}")
    args.splits = splits
    if args.config:
        try:
            block_n, num_warps, num_stages = (int(n) for n in args.config.split("/"))
        except ValueError:
            parser.error(f"--config takes TOKENS/WARPS/STAGES, e.g. 64/2/3; got {args.config!r}")
        args.config = (block_n, num_warps, num_stages)
    else:
        args.config = None
    if args.sms is not None and args.sms < 1:
        parser.error(f"--sms takes a number of SMs of 1 or more, got {args.sms}")
    return args


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        print("bench_paged_attention needs a CUDA GPU", file=sys.stderr)
        return 2
    try:
        with lab_sm_slice().sm_slice(args.sms) if args.sms else contextlib.nullcontext() as piece:
            return run(args, piece)
    except ConfigError as exc:
        print(f"bench_paged_attention: {exc}", file=sys.stderr)
        return 2


def lab_sm_slice():
    """scripts/lab/sm_slice.py: --sms runs on a CUDA green context, an experiment kept out of
    the package."""
    lab = str(Path(__file__).resolve().parent / "lab")
    if lab not in sys.path:  # asked for twice in a --sms run
        sys.path.insert(0, lab)
    import sm_slice

    return sm_slice


def sms_reached(num_programs: int) -> int:
    """Distinct SMs that `num_programs` programs of a probe kernel replayed from a CUDA graph on
    the current stream ran on (the graph as the timed calls are)."""
    sm_ids = lab_sm_slice().sm_ids
    ids = sm_ids(num_programs)  # compiled outside the capture
    synchronize()
    graph = capture_graph(lambda: ids.copy_(sm_ids(num_programs)))
    graph.replay()
    synchronize()
    return int(torch.unique(ids).numel())


def run(args: argparse.Namespace, piece) -> int:
    """Every row of the plan in `args` (parse_args), on `piece` of the GPU or the whole of it (None)."""
    started_s = time.perf_counter()
    metadata = run_metadata(" ".join([sys.executable, *sys.argv]))
    gpu_name = metadata["gpu"]
    if piece is not None:
        full_sms = torch.cuda.get_device_properties(0).multi_processor_count
        reached = sms_reached(4 * full_sms)
        metadata["sm_slice"] = {
            "num_sms": piece.num_sms,
            "asked": args.sms,
            "gpu_sms": full_sms,
            "sms_reached_by_probe": reached,
        }
        print(
            f"on a slice of {piece.num_sms} of the GPU's {full_sms} SMs (asked {args.sms}); a probe kernel's "
            f"{4 * full_sms} programs ran on {reached} distinct SMs"
        )
    copy_gbs = copy_bandwidth_gbs()
    print(f"{gpu_name}: copy bandwidth {copy_gbs:.0f} GB/s (read + write)")
    print(
        f"decode, H={NUM_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM} B={BLOCK_SIZE}, one layer; target >= "
        f"{TARGET_FRACTION:.0%} of copy at 8K+; 'same copy': a copy moving the row's bytes, timed the same way"
    )
    header = (
        f"{'precision':>9} {'context':>7} {'batch':>5} {'splits':>6} {'time_us':>8} "
        f"{'GB/s':>7} {'of copy':>7} {'same cp':>7} {'of same':>7}"
    )
    if args.sweep:
        header += f"  {'best config':<32} {'time_us':>8} {'of copy':>7}"
    print(header)
    rows = []
    for precision, context_len, batch_size in itertools.product(args.precisions, args.contexts, args.batches):
        if not fits_in_memory(precision, context_len, batch_size, args.window_tokens):
            print(f"{precision:>9} {context_len:>7} {batch_size:>5}  skipped: not enough free memory")
            continue
        bytes_read = kv_bytes_read(precision, context_len, batch_size, args.window_tokens)
        same_copy_gbs = same_bytes_copy_gbs(bytes_read, _copies(bytes_read))
        setup = Setup.make(precision, context_len, batch_size, args.window_tokens)
        row = bench_row(setup, copy_gbs, same_copy_gbs, args.sweep, args.splits, args.config)
        rows.append(row)
        print_row(row)
        for forced in row.get("by_splits", []):
            print(
                f"{'':>9} {'':>7} {'':>5} {forced['num_splits']:>6} "
                f"{forced.get('time_us', float('nan')):>8.1f} {'':>7} "
                f"{forced.get('fraction_of_copy', float('nan')):>7.1%}  {forced.get('error', '')}"
            )
        del setup
        torch.cuda.empty_cache()  # the pages and the graphs went with the setup
        if args.json:
            # After every setup, so a run stopped by a time limit keeps what it measured.
            write_json(args.json, metadata, rows, copy_gbs, args.sweep, args.window_tokens, is_complete=False)
    print(f"{time.perf_counter() - started_s:.0f} s")
    if args.json:
        write_json(args.json, metadata, rows, copy_gbs, args.sweep, args.window_tokens, is_complete=True)
        print(f"wrote {args.json}")
    return 0


def write_json(
    path: str, metadata: dict, rows: list, copy_gbs: float, sweep: bool, window_tokens: int, is_complete: bool
) -> None:
    """The record: `metadata` (lowvram.bench.record.run_metadata, taken once per run), then the rows."""
    result = {
        **metadata,
        "copy_bandwidth_gbs": round(copy_gbs, 1),
        "timing": "median of CUDA-graph replays; each graph holds calls over distinct pages (L2 cold)",
        "window_tokens": window_tokens,
        "sweep_configs": [dataclasses.asdict(config) for config in sweep_configs()] if sweep else None,
        "is_complete": is_complete,
        "rows": rows,
    }
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
