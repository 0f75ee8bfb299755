"""Registers and instruction counts of the decode kernels, compiled for a GPU without one.

Triton compiles a kernel ahead of time for the given architecture (90: H100/H200; 86: RTX
30xx; 75: GTX 1650) and its bundled cuobjdump reads the cubin: registers per thread, spills,
and the SASS of the kernel's longest loop (its main loop) counted by opcode. Registers bound
how many programs an SM holds (65,536 per SM); the main loop's length, over the tokens or K
rows one pass covers, is what a memory-bound kernel must issue per byte. Both show a
change's cost before any GPU run; they are a guide, not a timing.

    python scripts/lab/aot_kernels.py attention [--arch 90] [--bits 16,8,4] [--block-n 64] [--warps 2] [--stages 3]
    python scripts/lab/aot_kernels.py gemv [--arch 86] [--shape r1-distill-qwen-1.5b] [--rank 16] [--sms 16]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

SASS_LINE = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
PREDICATE = re.compile(r"^@!?U?P\w+\s+")


def sass_instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction) for each instruction in cuobjdump -sass output."""
    return [(int(m.group(1), 16), m.group(2)) for m in map(SASS_LINE.match, sass.splitlines()) if m]


def opcode(instruction: str) -> str:
    """The opcode without predicate or modifiers: "@!P1 LDG.E.U16 R1, ..." -> "LDG"."""
    return PREDICATE.sub("", instruction).split()[0].split(".")[0]


def longest_loop(instructions: list[tuple[int, str]]) -> list[str]:
    """The instructions between the target and the source of the longest backward branch."""
    best: list[str] = []
    for address, text in instructions:
        if opcode(text) != "BRA":
            continue
        target = re.search(r"0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address:
            start = int(target.group(1), 16)
            body = [t for a, t in instructions if start <= a <= address]
            if len(body) > len(best):
                best = body
    return best


def compile_kernel(
    fn,
    pointer_types: dict,
    constexprs: dict,
    arch: int,
    num_warps: int,
    num_stages: int,
    divisible: frozenset = frozenset(),
):
    """`fn` compiled for sm_`arch`, every pointer 16-byte aligned and every other argument
    a 32-bit integer (floats where `pointer_types` names them "fp32", tuples where it gives a
    tuple of types); the integers named in `divisible` are taken as multiples of 16, as Triton
    specialises them at launch when they are (row strides of aligned tensors): without it a
    kernel's loads may not vectorize."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, attrs = {}, {}
    for index, param in enumerate(fn.params):
        if param.is_constexpr:
            signature[param.name] = "constexpr"
        elif isinstance(pointer_types.get(param.name), tuple):
            signature[param.name] = pointer_types[param.name]
            for item, kind in enumerate(signature[param.name]):
                if kind.startswith("*"):
                    attrs[(index, item)] = [["tt.divisibility", 16]]
        elif param.name.endswith("_ptr"):
            signature[param.name] = pointer_types.get(param.name, "*fp16")
            attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[param.name] = pointer_types.get(param.name, "i32")
            if param.name in divisible:
                attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(
        source, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, "num_stages": num_stages}
    )


def usage(kernel) -> dict:
    """Registers, spill bytes, and the main loop's length and most frequent opcodes."""
    import triton

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
        path = f.name
    try:
        resources = subprocess.run(
            [os.path.join(tools, "cuobjdump"), "-res-usage", path], capture_output=True, text=True, check=True
        ).stdout
        sass = subprocess.run(
            [os.path.join(tools, "cuobjdump"), "-sass", path], capture_output=True, text=True, check=True
        ).stdout
    finally:
        os.unlink(path)
    found = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", resources))
    loop = longest_loop(sass_instructions(sass))
    return {
        "registers": int(found.get("REG", 0)),
        "spill_bytes": int(found.get("LOCAL", 0)),
        "loop_instructions": len(loop),
        "loop_opcodes": dict(Counter(map(opcode, loop)).most_common(12)),
    }


def attention(args) -> None:
    from lowvram.kernels import paged_attention as pa
    from lowvram.kernels import paged_attention_kernels

    for bits in (int(b) for b in args.bits.split(",")):
        block_n = args.block_n or pa.ASYNC_DECODE_TILE_TOKENS[bits]
        cache = "*fp16" if bits == 16 else "*u8"
        pointer_types = {
            # KVPages.kernel_tensors(): codes, scales and zeros, the FP16 window and its rows
            "cache": (cache, cache, *["*fp16"] * 6, "*i32"),
            "block_tables_ptr": "*i32",
            "context_lens_ptr": "*i32",
            "partial_out_ptr": "*fp32",
            "partial_lse_ptr": "*fp32",
            "scale_log2": "fp32",
        }
        # As paged_decode_attention lays them out: power-of-two tiles over the head's columns.
        constexprs = {
            "PAGE_SIZE": 16,
            "HEAD_DIM": args.head_dim,
            **pa.plane_layout(bits, args.head_dim),
            "BITS": bits,
            "BLOCK_G": args.group_width,
            "BLOCK_N": block_n,
            "IS_SPLIT": True,
            "HAS_WINDOW": args.window,
            "WIDE_OFFSETS": args.wide,
        }
        # q's row strides (heads x head size, head size) are multiples of 16 at the real shapes.
        kernel = compile_kernel(
            paged_attention_kernels._decode_kernel,
            pointer_types,
            constexprs,
            args.arch,
            args.warps,
            args.stages,
            frozenset({"stride_qs", "stride_qh"}),
        )
        found = usage(kernel)
        per_token = found["loop_instructions"] * args.warps / block_n
        print(
            f"decode attention, {bits}-bit pages, {block_n} tokens x {args.warps} warps, "
            f"{args.stages} stages: {found['registers']} registers, {found['spill_bytes']} bytes spilled, "
            f"loop {found['loop_instructions']} instructions per warp ({per_token:.1f} per token); "
            f"{found['loop_opcodes']}"
        )


def gemv(args) -> None:
    """The one-row W4A16 kernel at each projection of the shape (with the norm prologue where the
    decoder layer fuses it, RoPE + KV store on q/k/v; the K-in-thread kernel where row_config
    picks it), and the tiled kernel for 8 rows."""
    import triton
    from lab_shapes import projection_shapes
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lowvram.kernels import w4a16_gemv as g

    def compile_kernel(fn, signature, constexprs, num_warps, attrs=None):
        signature = {**signature, **dict.fromkeys(constexprs, "constexpr")}
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        return usage(triton.compile(source, target=GPUTarget("cuda", args.arch, 32), options={"num_warps": num_warps}))

    awq = ("*i32", "*i32", "*fp16")
    split = ("*fp32", "*i32")
    lora = ("*fp16", "*fp16", "*fp32", "i32", "i32", "i32", "i32") if args.rank else ()
    norm = ("*fp16", "*fp16", "*fp16", "fp32")
    pages = ("*u8", "*fp16", "*fp16", "*fp16", "*i32")
    rope = ("*fp32", "*fp32", "i32", "*i64", "*i64", "i32", "i32", "i32", pages, pages)
    ints = ("N", "K", "num_packed_cols", "K_BLOCKS_PER_SPLIT")
    common = {"GROUP_SIZE": args.group_size, "HAS_BIAS": False, "HAS_LORA": bool(args.rank)}
    common |= {"BLOCK_R": g.lora_block_r(args.rank), "EVEN_N": True, "IS_PARTIAL": True}
    for name, (k, n) in projection_shapes(args.shape).items():
        is_qkv = name == "qkv"
        config = g.row_config(n, k, args.group_size, args.sms, bool(args.rank), 128 if is_qkv else 64)
        prologue = g.PROLOGUE_SILU_MUL if name == "down" else g.PROLOGUE_RMS_NORM if name in ("qkv", "gate_up") else 0
        row = {"x_ptr": "*fp16", "awq": awq, "bias_ptr": "*fp16", "y_ptr": "*fp16", "split": split}
        fused = {"PROLOGUE": prologue, "HAS_RESIDUAL": prologue == 1, "ROW_BLOCK": triton.next_power_of_2(k)}
        if config.get("k_in_thread"):  # the K-in-thread kernel of wide layers without compensation
            signature = {**row, "norm": norm if prologue == 1 else (), **dict.fromkeys(ints[:3], "i32")}
            signature["GROUPS_PER_SPLIT"] = "i32"
            constexprs = {"GROUP_SIZE": args.group_size, "BLOCK_C": config["block_n"] // 8, "TILE_ROWS": 16}
            constexprs |= {"UNROLL": 2, "EVEN_N": True, "HAS_BIAS": False, "IS_PARTIAL": True, **fused}
            found = compile_kernel(g._wide_row_kernel, signature, constexprs, config["num_warps"])
        else:
            signature = {**row, "lora": lora, "norm": norm if prologue == 1 else (), "rope": rope if is_qkv else ()}
            signature |= dict.fromkeys(ints, "i32")
            constexprs = {**common, "BLOCK_N": config["block_n"], "BLOCK_K": config["block_k"], **fused}
            constexprs |= {"REDUCE_AT_END": config["reduce_at_end"], "ROPE_KV": is_qkv}
            constexprs |= {"LORA_ONCE": bool(args.rank) and not config["reduce_at_end"]}
            constexprs["STORE"] = (4, 15, 64, True, 16) if is_qkv else ()
            names = ("N", "K", "num_packed_cols")
            attrs = {(g._row_kernel.arg_names.index(i),): [["tt.divisibility", 16]] for i in names}
            found = compile_kernel(g._row_kernel, signature, constexprs, 4, attrs)
        print(
            f"GEMV {name} (K={k}, N={n}) {config}: {found['registers']} registers, {found['spill_bytes']} bytes "
            f"spilled, loop {found['loop_instructions']} instructions per warp; {found['loop_opcodes']}"
        )
        config = g.tiled_config(8, n, k, args.group_size, args.sms)
        signature = {"x_ptr": "*fp16", "weight": awq, "bias_ptr": "*fp16", "y_ptr": "*fp16", "split": split}
        signature |= {"lora": lora, **dict.fromkeys(("M", "N", "K", "num_packed_cols"), "i32")}
        signature |= {"strides": ("i32", "i32", "i32"), "K_BLOCKS_PER_SPLIT": "i32"}
        constexprs = {**common, "BLOCK_M": 16, "BLOCK_N": config["block_n"], "BLOCK_K": config["block_k"]}
        constexprs["IS_DENSE"] = False
        found = compile_kernel(g._tiled_kernel, signature, constexprs, 4)
        print(f"tiled {name}, 8 rows {config}: {found['registers']} registers, {found['spill_bytes']} bytes spilled")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kernel", choices=("attention", "gemv"))
    parser.add_argument("--arch", type=int, default=90, help="compute capability as one number (90, 86, 75)")
    parser.add_argument("--bits", default="16,8,4", help="attention: page precisions")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument(
        "--block-n",
        type=int,
        default=0,
        help="attention: tokens per tile (default: the kernel's default for the page bits, "
        "heads up to 128 on GPUs with cp.async)",
    )
    parser.add_argument("--warps", type=int, default=2, help="attention: warps per program")
    parser.add_argument("--stages", type=int, default=3, help="attention: pipeline stages")
    parser.add_argument("--wide", action="store_true", help="attention: int64 page offsets")
    parser.add_argument(
        "--group-width",
        type=int,
        default=8,
        help="attention: query rows per program (8: groups up to 8 heads, token by token; 16: wider)",
    )
    parser.add_argument(
        "--window", action="store_true", help="attention: the variant that reads pages kept in FP16 beside the codes"
    )
    parser.add_argument("--shape", default="r1-distill-qwen-1.5b", help="gemv: model shape")
    parser.add_argument("--rank", type=int, default=16, help="gemv: compensation rank (0: none)")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--sms", type=int, default=16, help="gemv: the GPU's SMs, which set the K splits")
    args = parser.parse_args()
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    attention(args) if args.kernel == "attention" else gemv(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
