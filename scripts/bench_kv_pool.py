"""KV pool on a CUDA GPU: one context growing to 128K tokens under an emulated 4 GB card
with spill, decode speed with and without spill, and spill/prefetch bandwidth against
the host link.

What runs is the attention + KV part of R1-Distill-Qwen-1.5B's decode step, not the
whole model: 28 layers, each storing one new token's K/V (`write_kv`) and attending
over its paged context (`paged_decode_attention`), with random q, K and V and no
weights (FP16 weights of the 1.5B shape alone exceed a 4 GB card). The KV pool gets
the device share a 4 GB card leaves after INT4 weights and workspace
(`--kv-device-gib`, default 1.5 GiB); pages beyond it spill to the host.

Rows:
- link: pinned host <-> device copy bandwidth (the bound for every transfer below);
- transfer: pool spill / fetch / swap throughput per backend, against the link;
- growth: the most device memory the driver reported in use (managed pages included)
  while one context grew to each context length, against the emulated card;
- decode: tokens/s of the 28-layer attention + KV step at each context, for pages all
  on the device (plain device memory, and managed memory without spill) and with spill.

The pinned backend cannot decode a context larger than its device share (a step's
pages must all be resident), so it appears in the transfer rows only.

    python scripts/bench_kv_pool.py [--json results.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import time

import torch

from lowvram.kv_pool import DeviceKVPool, KVShape, ManagedKVPool, PinnedKVPool

GIB = 2**30
NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 28, 12, 2, 128, 16
CONTEXT_LENS = (4096, 32768, 131072)
FILL_CHUNK_TOKENS = 4096
TRANSFER_GIB = 1.0


def git_commit() -> str | None:
    try:
        result = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except OSError:
        return None
    return result.stdout.strip() or None


def _seconds(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def link_rows() -> list[dict]:
    """Pinned host <-> device copies of TRANSFER_GIB, best of three."""
    num_bytes = int(TRANSFER_GIB * GIB)
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    rows = []
    for direction, dst, src in (("h2d", device, host), ("d2h", host, device)):
        seconds = min(_seconds(lambda: dst.copy_(src, non_blocking=True)) for _ in range(3))
        rows.append({"kind": "link", "direction": direction, "bytes": num_bytes,
                     "gbs": round(num_bytes / seconds / 1e9, 1)})
    return rows


def _transfer_row(backend: str, direction: str, num_bytes: int, seconds: float, link_gbs: float) -> dict:
    gbs = num_bytes / seconds / 1e9
    return {"kind": "transfer", "backend": backend, "direction": direction, "bytes": num_bytes,
            "time_ms": round(seconds * 1e3, 2), "gbs": round(gbs, 1), "fraction_of_link": round(gbs / link_gbs, 3)}


def managed_transfer_rows(shape: KVShape, num_blocks: int, link_gbs: float) -> list[dict]:
    """um: every page resident and touched, then all but one spilled, then all fetched back."""
    from lowvram.managed_memory import ManagedMemory

    pool = ManagedKVPool(shape, num_blocks, "fp16", "cuda", max_device_blocks=num_blocks,
                         memory=ManagedMemory(torch.device("cuda")),
                         budget_bytes=2 * num_blocks * shape.block_bytes("fp16"))
    for pages in pool.pages:
        pages.k.fill_(1.0)
        pages.v.fill_(1.0)
    spilled = pool.spilled_bytes
    seconds = _seconds(lambda: (pool.set_max_device_blocks(1), pool.synchronize()))
    rows = [_transfer_row("um", "spill", pool.spilled_bytes - spilled, seconds, link_gbs)]
    pool.set_max_device_blocks(num_blocks)
    fetched = pool.fetched_bytes
    seconds = _seconds(lambda: pool.ensure_resident(range(num_blocks)))
    rows.append(_transfer_row("um", "fetch", pool.fetched_bytes - fetched, seconds, link_gbs))
    return rows


def pinned_transfer_rows(shape: KVShape, num_blocks: int, link_gbs: float) -> list[dict]:
    """pinned: a device share of `num_blocks` pages and a host tier as large; spill, then swap."""
    pool = PinnedKVPool(shape, 2 * num_blocks, "fp16", "cuda", max_device_blocks=num_blocks,
                        num_host_blocks=num_blocks)
    spilled = pool.spilled_bytes
    # Pages num..2num hold no data yet: this moves pages 0..num out and nothing in.
    seconds = _seconds(lambda: (pool.ensure_resident(range(num_blocks, 2 * num_blocks)), pool.synchronize()))
    rows = [_transfer_row("pinned", "spill", pool.spilled_bytes - spilled, seconds, link_gbs)]
    moved = pool.spilled_bytes + pool.fetched_bytes
    seconds = _seconds(lambda: (pool.ensure_resident(range(num_blocks)), pool.synchronize()))
    rows.append(_transfer_row("pinned", "swap", pool.spilled_bytes + pool.fetched_bytes - moved, seconds, link_gbs))
    return rows


class DecodeBench:
    """One sequence whose context grows in a pool; decode steps of all 28 layers."""

    def __init__(self, pool, max_context: int):
        self.pool = pool
        self.num_table_blocks = -(-max_context // BLOCK_SIZE) + 1
        self.table = torch.arange(self.num_table_blocks, dtype=torch.int32, device="cuda")[None]  # [1, max_blocks]
        gen = torch.Generator(device="cuda").manual_seed(0)
        self.q = torch.randn(1, NUM_HEADS, HEAD_DIM, device="cuda", dtype=torch.float16, generator=gen)
        self.kv_new = torch.randn(2, NUM_LAYERS, 1, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.float16,
                                  generator=gen)
        self.context_len = 0

    def _resident(self, num_tokens: int) -> None:
        blocks = list(range(-(-num_tokens // BLOCK_SIZE)))
        self.pool.record_step({0: blocks})
        self.pool.ensure_resident(blocks)

    def grow_to(self, num_tokens: int, baseline_free: int) -> int:
        """Write K/V for positions up to `num_tokens`, a chunk at a time, as a prefill would.
        Returns the most device memory the driver reported in use after any chunk."""
        from lowvram.kernels.kv_write import write_kv

        peak = 0

        gen = torch.Generator(device="cuda").manual_seed(num_tokens)
        while self.context_len < num_tokens:
            end = min(num_tokens, self.context_len + FILL_CHUNK_TOKENS)
            self._resident(end)
            slots = torch.arange(self.context_len, end, device="cuda")
            k = torch.randn(end - self.context_len, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.float16,
                            generator=gen)
            for pages in self.pool.pages:
                write_kv(k, k, slots, pages)
            self.context_len = end
            torch.cuda.synchronize()
            peak = max(peak, driver_used_bytes(baseline_free))
        return peak

    def decode(self, num_steps: int) -> float:
        """Seconds per decode step (pool bookkeeping, 28 x (write_kv + decode attention))."""
        from lowvram.kernels.kv_write import write_kv
        from lowvram.kernels.paged_attention import paged_decode_attention

        scale = HEAD_DIM**-0.5

        def steps(count: int) -> None:
            for _ in range(count):
                self._resident(self.context_len + 1)
                slot = torch.tensor([self.context_len], device="cuda")
                context_lens = torch.tensor([self.context_len + 1], dtype=torch.int32, device="cuda")
                for layer, pages in enumerate(self.pool.pages):
                    write_kv(self.kv_new[0, layer], self.kv_new[1, layer], slot, pages)
                    paged_decode_attention(self.q, pages, self.table, context_lens, scale,
                                           max_context_len=self.context_len + 1)
                self.context_len += 1

        steps(2)  # warm-up: kernel compilation, first faults
        return _seconds(lambda: steps(num_steps)) / num_steps


def driver_used_bytes(baseline_free: int) -> int:
    free, _ = torch.cuda.mem_get_info()
    return baseline_free - free


def run_decode(name: str, pool, contexts: list[int], num_steps: int, baseline_free: int, card_bytes: int,
               is_spilling: bool) -> list[dict]:
    bench = DecodeBench(pool, max(contexts) + num_steps + 8)
    rows = []
    bytes_per_token = pool.shape.block_bytes(pool.precision) // BLOCK_SIZE
    for context in contexts:
        used = bench.grow_to(context, baseline_free)
        growth = {"kind": "growth", "backend": name, "context_tokens": context, "device_used_bytes": used,
                  "pool_device_bytes": pool.device_bytes, "card_bytes": card_bytes,
                  "is_within_card": used <= card_bytes, "num_blocks_on_host": pool.num_blocks_on_host()}
        step_s = bench.decode(num_steps)
        kv_read = bench.context_len * bytes_per_token
        decode = {"kind": "decode", "backend": name, "precision": pool.precision, "context_len": context,
                  "is_spilling": is_spilling and pool.num_blocks_on_host() > 0, "step_ms": round(step_s * 1e3, 3),
                  "tokens_per_s": round(1 / step_s, 1), "kv_gbs": round(kv_read / step_s / 1e9, 1),
                  "num_blocks_on_host": pool.num_blocks_on_host()}
        rows += [growth, decode]
        print(f"{name:>12} {context:>7} {used / GIB:>9.2f} {pool.device_bytes / GIB:>9.2f} "
              f"{pool.num_blocks_on_host():>8} {decode['step_ms']:>9.2f} {decode['tokens_per_s']:>8.1f} "
              f"{decode['kv_gbs']:>7.1f}")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    parser.add_argument("--card-gib", type=float, default=4.0, help="emulated card size (default 4)")
    parser.add_argument("--kv-device-gib", type=float, default=1.5,
                        help="device share of the KV pool on that card (default 1.5)")
    parser.add_argument("--precision", default="fp16", choices=("fp16", "int8", "int4"))
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per context")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_kv_pool needs a CUDA GPU", file=sys.stderr)
        return 2
    try:
        from lowvram.managed_memory import ManagedMemory

        ManagedMemory(torch.device("cuda"))
    except Exception as exc:  # the um rows need cuda-bindings
        print(f"bench_kv_pool needs cuda-bindings for the managed pool: {exc}", file=sys.stderr)
        return 2
    import triton

    gpu_name = torch.cuda.get_device_name(0)
    shape = KVShape(NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.float16)
    print(f"{gpu_name}: attention + KV of the 1.5B shape ({NUM_LAYERS} layers, {NUM_HEADS}/{NUM_KV_HEADS} heads, "
          f"head_dim {HEAD_DIM}), random q/K/V, no weights")
    rows = link_rows()
    torch.cuda.empty_cache()
    link_gbs = min(r["gbs"] for r in rows)
    print("host link: " + ", ".join(f"{r['direction']} {r['gbs']:.1f} GB/s" for r in rows))
    num_transfer = max(2, int(TRANSFER_GIB * GIB // shape.block_bytes("fp16")))
    transfers = managed_transfer_rows(shape, num_transfer, link_gbs)
    torch.cuda.empty_cache()
    transfers += pinned_transfer_rows(shape, num_transfer, link_gbs)
    torch.cuda.empty_cache()
    for row in transfers:
        rows.append(row)
        print(f"{row['backend']:>7} {row['direction']:>6}: {row['bytes'] / GIB:.2f} GiB in {row['time_ms']:.1f} ms = "
              f"{row['gbs']:.1f} GB/s ({row['fraction_of_link']:.0%} of the slower link direction)")

    card_bytes = int(args.card_gib * GIB)
    block_bytes = shape.block_bytes(args.precision)
    num_blocks = -(-(max(CONTEXT_LENS) + args.steps * 2 + 64) // BLOCK_SIZE)
    share_blocks = int(args.kv_device_gib * GIB // block_bytes)
    free_bytes, total_bytes = torch.cuda.mem_get_info()
    pool_bytes = num_blocks * block_bytes
    if 2 * pool_bytes > free_bytes:  # the device-only pool and a managed pool must both fit at once, with room
        print(f"skipping decode: a {pool_bytes / GIB:.2f} GiB pool needs more than half of the "
              f"{free_bytes / GIB:.2f} GiB free", file=sys.stderr)
    else:
        print(f"decode, {args.precision} pages: KV device share {share_blocks} pages ({args.kv_device_gib} GiB) of an "
              f"emulated {args.card_gib} GiB card; largest context {max(CONTEXT_LENS)} tokens = "
              f"{max(CONTEXT_LENS) * block_bytes / BLOCK_SIZE / GIB:.2f} GiB of KV")
        print(f"{'pool':>12} {'context':>7} {'used GiB':>9} {'pool GiB':>9} {'on host':>8} {'step ms':>9} "
              f"{'tok/s':>8} {'KV GB/s':>7}")
        # Cap torch's allocator as a 4 GB card would; managed pages are outside it and
        # counted by the driver (`device_used_bytes`).
        torch.cuda.set_per_process_memory_fraction(min(1.0, card_bytes / total_bytes))
        for name, spill_share in (("device", None), ("um-resident", num_blocks), ("um-spill", share_blocks)):
            torch.cuda.synchronize()
            baseline_free = torch.cuda.mem_get_info()[0]
            if spill_share is None:
                torch.cuda.set_per_process_memory_fraction(1.0)  # all pages on the device: over the card at 128K
                pool = DeviceKVPool(shape, num_blocks, args.precision, "cuda")
            else:
                torch.cuda.set_per_process_memory_fraction(min(1.0, card_bytes / total_bytes))
                memory = ManagedMemory(torch.device("cuda"))
                pool = ManagedKVPool(shape, num_blocks, args.precision, "cuda", max_device_blocks=spill_share,
                                     memory=memory, budget_bytes=num_blocks * block_bytes)
            rows += run_decode(name, pool, list(CONTEXT_LENS), args.steps, baseline_free, card_bytes,
                               is_spilling=name == "um-spill")
            del pool
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    growth = [r for r in rows if r["kind"] == "growth" and r["backend"] == "um-spill"]
    if growth:
        peak = max(r["device_used_bytes"] for r in growth)
        print(f"um-spill peak device use {peak / GIB:.2f} GiB against the {args.card_gib} GiB card: "
              f"{'within' if peak <= card_bytes else 'OVER'}")
    if args.json:
        result = {
            "command": " ".join([sys.executable, *sys.argv]),
            "gpu": gpu_name,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": git_commit(),
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "triton": triton.__version__, "cuda": torch.version.cuda},
            "what": "attention + KV of the 28-layer 1.5B shape only (random q/K/V, no weights)",
            "rows": rows,
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
