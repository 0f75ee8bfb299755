"""KV-cache pages and their quantization, in plain torch.

A layer's `KVPages` holds K and V pages of `block_size` tokens as FP16 (float32 on the CPU) or
as INT8/INT4 codes with an FP16 scale and zero per (token, KV head): x ~ (q - zero) * scale.
Each row's range is widened to include 0, which keeps zero inside [0, qmax] where FP16 holds it
to 1/16 of a code (real K/V rows straddle 0 anyway). Rounding is floor(v + 0.5) with the
FP16-rounded scale and zero, which kv_write's kernel reproduces byte for byte. Quantized pages
may also keep an FP16 copy (the pool's recent window): `window_row[page]` is its row in
`window_k`/`window_v` (-1: none); its codes stay valid too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowvram.errors import KernelError

PRECISIONS = ("fp16", "int8", "int4")
BITS_BY_PRECISION = {"fp16": 16, "int8": 8, "int4": 4}

# The smallest normal FP16 number: a subnormal scale would lose the error bound's relative precision.
MIN_SCALE = 2.0**-14


@dataclass
class KVPages:
    """One layer's paged K/V cache in one precision.

    k, v: [num_blocks, block_size, num_kv_heads, head_dim] float16/float32 ("fp16") or uint8 codes
    ("int8"; "int4" packs element 2i in the low nibble of [..., head_dim // 2]). k_scale, k_zero,
    v_scale, v_zero: float16 [num_blocks, block_size, num_kv_heads], quantized only. window_k,
    window_v: [num_window_pages, block_size, num_kv_heads, head_dim] FP16 copies, window_row: int32
    [num_blocks] (-1 = not kept); all three or none, quantized only.
    """

    k: torch.Tensor
    v: torch.Tensor
    precision: str = "fp16"
    k_scale: torch.Tensor | None = None
    k_zero: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    v_zero: torch.Tensor | None = None
    window_k: torch.Tensor | None = None
    window_v: torch.Tensor | None = None
    window_row: torch.Tensor | None = None

    @property
    def bits(self) -> int:
        return BITS_BY_PRECISION[self.precision]

    @property
    def is_quantized(self) -> bool:
        return self.precision != "fp16"

    @property
    def num_blocks(self) -> int:
        return self.k.shape[0]

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k.shape[3] * 2 if self.precision == "int4" else self.k.shape[3]

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def has_window(self) -> bool:
        return self.window_row is not None

    def window_pages(self) -> KVPages:
        return KVPages(k=self.window_k, v=self.window_v)

    def kernel_tensors(self) -> tuple[torch.Tensor, ...]:
        """(k, v, k_scale, k_zero, v_scale, v_zero, window_k, window_v, window_row) for the kernels;
        the code arrays stand in for those these pages lack."""
        scales = (
            (self.k_scale, self.k_zero, self.v_scale, self.v_zero)
            if self.is_quantized
            else (self.k, self.k, self.v, self.v)
        )
        window = (self.window_k, self.window_v, self.window_row) if self.has_window else (self.k, self.v, self.k)
        return (self.k, self.v, *scales, *window)

    def validate(self) -> None:
        """Raise KernelError unless the tensors match the layout above."""
        if self.precision not in PRECISIONS:
            raise KernelError(f"KVPages.precision is {self.precision!r}; expected one of {PRECISIONS}")
        if self.k.dim() != 4 or not self.k.is_contiguous() or not self.v.is_contiguous():
            raise KernelError(
                f"KVPages.k and v must be contiguous [num_blocks, block_size, num_kv_heads, head_dim (head_dim // 2 "
                f"for int4)]; k is {tuple(self.k.shape)} with strides {self.k.stride()}"
            )
        if self.v.shape != self.k.shape or self.v.dtype != self.k.dtype or self.v.device != self.k.device:
            got = [(tuple(t.shape), t.dtype, t.device) for t in (self.v, self.k)]
            raise KernelError(f"KVPages.v {got[0]} must match KVPages.k {got[1]}")
        floats = (torch.float16, torch.float32, torch.bfloat16)
        if not self.is_quantized:
            if self.window_k is not None or self.window_row is not None:
                raise KernelError("fp16 KVPages cannot keep an FP16 window: every page already is FP16")
            if self.k.dtype not in floats:
                raise KernelError(f"fp16 KVPages.k is {self.k.dtype}; expected float16 (float32 or bfloat16 on CPU)")
            return
        if self.k.dtype != torch.uint8:
            raise KernelError(f"{self.precision} KVPages.k has dtype {self.k.dtype}; expected uint8 codes")
        window = (self.window_k, self.window_v, self.window_row)
        if any(t is None for t in window) and any(t is not None for t in window):
            raise KernelError("KVPages.window_k, window_v and window_row go together; some are missing")
        scale_shape = tuple(self.k.shape[:3])
        expected = {name: (scale_shape, (torch.float16,)) for name in ("k_scale", "k_zero", "v_scale", "v_zero")}
        if self.has_window:
            window_shape = (*self.window_k.shape[:1], self.block_size, self.num_kv_heads, self.head_dim)
            expected |= {"window_k": (window_shape, floats), "window_v": (window_shape, (self.window_k.dtype,))}
            expected["window_row"] = ((self.num_blocks,), (torch.int32,))
        for name, (shape, dtypes) in expected.items():
            t = getattr(self, name)
            if t is None or tuple(t.shape) != shape or t.dtype not in dtypes or not t.is_contiguous():
                got = "missing" if t is None else f"{tuple(t.shape)} {t.dtype}"
                raise KernelError(f"KVPages.{name} is {got}; expected contiguous {dtypes[0]} {shape}")
            if t.device != self.k.device:
                raise KernelError(f"KVPages.{name} is on {t.device}; expected {self.k.device}")


def allocate_pages(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    precision: str,
    dtype: torch.dtype = torch.float16,
    device: torch.device | str = "cpu",
) -> KVPages:
    """Zeroed pages for one layer. `dtype` applies to "fp16" pages only."""
    if precision not in PRECISIONS:
        raise KernelError(f"KV precision {precision!r} is not one of {PRECISIONS}")
    if precision == "int4" and head_dim % 2:
        raise KernelError(f"int4 KV pages need an even head_dim, got {head_dim}")
    code_dim = head_dim // 2 if precision == "int4" else head_dim
    shape = (num_blocks, block_size, num_kv_heads, code_dim)
    if precision == "fp16":
        return KVPages(*[torch.zeros(shape, dtype=dtype, device=device) for _ in range(2)], precision)
    codes = [torch.zeros(shape, dtype=torch.uint8, device=device) for _ in range(2)]
    return KVPages(*codes, precision, *[torch.zeros(shape[:3], dtype=torch.float16, device=device) for _ in range(4)])


def quantize_kv(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows x [..., D] -> (q uint8 [..., D] or, 4 bits, [..., D // 2] low nibble first, scale and
    zero float16 [...]), with |x - (q - zero) * scale| <= scale / 2 within FP16's range."""
    if bits not in (8, 4):
        raise KernelError(f"quantize_kv supports 8 or 4 bits, got {bits}")
    if bits == 4 and x.shape[-1] % 2:
        raise KernelError(f"4-bit quantization needs an even last dim, got {x.shape[-1]}")
    x = x.float()
    qmax = torch.full(x.shape[:-1], float(2**bits - 1), dtype=torch.float32, device=x.device)
    row_min = x.amin(dim=-1).clamp(max=0.0)
    row_max = x.amax(dim=-1).clamp(min=0.0)
    # Divide by a tensor: CUDA turns division by a scalar into a reciprocal multiply.
    scale = ((row_max - row_min) / qmax).clamp(min=MIN_SCALE).half()
    scale_f32 = scale.float()
    zero = (-row_min / scale_f32).half()
    codes = torch.floor(x / scale_f32[..., None] + zero.float()[..., None] + 0.5)
    codes = torch.minimum(codes.clamp(min=0.0), qmax[..., None]).to(torch.uint8)
    if bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return codes, scale, zero


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, head_dim: int) -> torch.Tensor:
    """Inverse of `quantize_kv`: float32 [..., head_dim]."""
    if bits == 4:
        q = torch.stack((q & 0x0F, q >> 4), dim=-1).flatten(-2)  # low nibble first
    elif bits != 8:
        raise KernelError(f"dequantize_kv supports 8 or 4 bits, got {bits}")
    if q.shape[-1] != head_dim:
        raise KernelError(f"codes unpack to {q.shape[-1]} values per row; expected head_dim {head_dim}")
    return (q.float() - zero.float()[..., None]) * scale.float()[..., None]


def gather_kv(pages: KVPages, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the slots, dequantized: float32 [num_slots, num_kv_heads, head_dim]."""
    slots = slots.long()
    k_rows = pages.k.flatten(0, 1)[slots]  # [num_blocks * B, Hkv, Dc] -> [N, Hkv, Dc]
    v_rows = pages.v.flatten(0, 1)[slots]
    if not pages.is_quantized:
        return k_rows.float(), v_rows.float()
    k, v = (
        dequantize_kv(rows, scale.flatten(0, 1)[slots], zero.flatten(0, 1)[slots], pages.bits, pages.head_dim)
        for rows, scale, zero in ((k_rows, pages.k_scale, pages.k_zero), (v_rows, pages.v_scale, pages.v_zero))
    )
    if pages.has_window:
        is_window, window_slots = window_slots_of(pages, slots)
        k[is_window] = pages.window_k.flatten(0, 1)[window_slots].float()  # [num_window_pages * B, Hkv, D] rows
        v[is_window] = pages.window_v.flatten(0, 1)[window_slots].float()
    return k, v


def window_slots_of(pages: KVPages, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Which `slots` lie in pages kept in FP16, and their slots in the window arrays."""
    block_size = pages.block_size
    rows = pages.window_row.long()[slots // block_size]
    is_window = rows >= 0
    return is_window, rows[is_window] * block_size + slots[is_window] % block_size


def store_kv(pages: KVPages, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write rows k, v [N, Hkv, D] into `slots` (all valid), quantizing as the pages require."""
    slots = slots.long()
    if not pages.is_quantized:
        pages.k.view(-1, *pages.k.shape[2:])[slots] = k.to(pages.k.dtype)  # [num_blocks * B, Hkv, D]
        pages.v.view(-1, *pages.v.shape[2:])[slots] = v.to(pages.v.dtype)
        return
    for x, codes, scale, zero in (
        (k, pages.k, pages.k_scale, pages.k_zero),
        (v, pages.v, pages.v_scale, pages.v_zero),
    ):
        q, s, z = quantize_kv(x, pages.bits)
        codes.view(-1, *codes.shape[2:])[slots] = q  # [num_blocks * B, Hkv, Dc]
        scale.view(-1, scale.shape[2])[slots] = s
        zero.view(-1, zero.shape[2])[slots] = z
    if pages.has_window:
        is_window, window_slots = window_slots_of(pages, slots)
        store_kv(pages.window_pages(), window_slots, k[is_window], v[is_window])


def copy_page(pages: KVPages, src: int, dst: int) -> None:
    """Copy page `src` onto `dst`, with its FP16 copy, or a dequantized one when only dst is kept."""
    for tensor in (pages.k, pages.v, pages.k_scale, pages.k_zero, pages.v_scale, pages.v_zero):
        if tensor is not None:
            tensor[dst].copy_(tensor[src])
    if not pages.has_window:
        return
    src_row, dst_row = pages.window_row[[src, dst]].tolist()
    if dst_row < 0:
        return
    if src_row >= 0:
        pages.window_k[dst_row].copy_(pages.window_k[src_row])
        pages.window_v[dst_row].copy_(pages.window_v[src_row])
        return
    offsets = torch.arange(pages.block_size, device=pages.device)
    k, v = gather_kv(pages, src * pages.block_size + offsets)  # the codes just copied, dequantized
    pages.window_k[dst_row].copy_(k)
    pages.window_v[dst_row].copy_(v)
