"""KV quantization (lowvram.kernels.kv_quant) and the write_kv kernel against its reference.

On a machine without CUDA the kernel runs in the Triton interpreter
(tests/conftest.py sets TRITON_INTERPRET=1); with CUDA it runs on the GPU.
"""

import pytest
import torch

from lowvram.errors import KernelError
from lowvram.kernels import kv_write
from lowvram.kernels.dispatch import use_triton
from lowvram.kernels.kv_quant import MIN_SCALE, allocate_pages, dequantize_kv, quantize_kv
from lowvram.kernels.kv_write import write_kv, write_kv_ref

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
POISON_CODE = 0xAB
POISON_FLOAT = -77.0


def test_kernel_path_is_exercised():
    # Without this the kernel-vs-reference tests would compare the reference with itself.
    assert use_triton("write_kv", DEVICE, use_reference=False) and not kv_write.FORCE_REFERENCE


def _rows(num_rows: int, dim: int, generator: torch.Generator) -> torch.Tensor:
    """Rows of the shapes that break naive quantizers: one-signed, constant, zero, tiny, huge."""
    x = torch.randn(num_rows, dim, generator=generator) * 3.0
    x[0] += 50.0  # all positive, far from 0
    x[1] -= 50.0  # all negative
    x[2] = 0.0
    x[3] = 7.25  # constant
    x[4] *= 1e-5  # below MIN_SCALE resolution
    x[5] *= 3000.0  # towards the FP16 limit
    return x.half().float()  # values an FP16 model would produce


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_error_is_at_most_half_a_step(bits):
    generator = torch.Generator().manual_seed(0)
    x = _rows(64, 128, generator)
    q, scale, zero = quantize_kv(x, bits)
    restored = dequantize_kv(q, scale, zero, bits, head_dim=128)
    step = scale.float()[:, None]
    error_in_steps = ((x - restored).abs() / step).max().item()
    print(f"int{bits}: largest |x - dq| = {error_in_steps:.6f} steps")
    assert error_in_steps <= 0.5 + 1e-4

    # The step is the row range over the code range (not a loose, larger one).
    qmax = 2**bits - 1
    row_range = x.amax(-1).clamp(min=0) - x.amin(-1).clamp(max=0)
    expected_scale = (row_range / qmax).clamp(min=MIN_SCALE)
    assert torch.allclose(scale.float(), expected_scale, rtol=1e-3, atol=0)
    assert bool(((zero.float() >= 0) & (zero.float() <= qmax + 0.5)).all())


def test_int4_nibble_order():
    # Row range 0..15 gives scale 1 and zero 0, so the codes are the values themselves.
    x = torch.tensor([[0.0, 1.0, 2.0, 15.0, 7.0, 8.0]])
    q, scale, zero = quantize_kv(x, 4)
    assert scale.item() == 1.0 and zero.item() == 0.0
    assert q.tolist() == [[0 + 16 * 1, 2 + 16 * 15, 7 + 16 * 8]]

    # Unpack random codes with integer arithmetic, independent of the bit operations under test.
    generator = torch.Generator().manual_seed(1)
    y = torch.randn(8, 32, generator=generator)
    q, scale, zero = quantize_kv(y, 4)
    unpacked = [[code for byte in row for code in (byte % 16, byte // 16)] for row in q.tolist()]
    expected = (torch.tensor(unpacked, dtype=torch.float32) - zero.float()[:, None]) * scale.float()[:, None]
    assert torch.equal(dequantize_kv(q, scale, zero, 4, 32), expected)


def _poisoned_pages(precision, num_blocks, block_size, num_kv_heads, head_dim, dtype):
    pages = allocate_pages(num_blocks, block_size, num_kv_heads, head_dim, precision, dtype=dtype, device=DEVICE)
    for name in ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero"):
        tensor = getattr(pages, name)
        if tensor is not None:
            tensor.fill_(POISON_CODE if tensor.dtype == torch.uint8 else POISON_FLOAT)
    return pages


def _page_tensors(pages):
    names = ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero")
    return {name: getattr(pages, name) for name in names if getattr(pages, name) is not None}


def _check_write_matches_reference(precision, block_size, num_kv_heads, head_dim, dtype, slot_dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    num_blocks, num_tokens = 8, 40
    # k and v as strided views of one fused projection, as the model produces them.
    fused = torch.randn(num_tokens, 3, num_kv_heads, head_dim, generator=generator) * 2.0
    fused[0] += 10.0
    fused[1, :, 0] = 0.0
    fused = fused.to(device=DEVICE, dtype=dtype)
    k, v = fused[:, 1], fused[:, 2]  # [T, Hkv, D], not contiguous
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[::7] = -1  # padding rows
    slots = slots.to(device=DEVICE, dtype=slot_dtype)

    by_kernel = _poisoned_pages(precision, num_blocks, block_size, num_kv_heads, head_dim, dtype)
    by_reference = _poisoned_pages(precision, num_blocks, block_size, num_kv_heads, head_dim, dtype)
    write_kv(k, v, slots, by_kernel)
    write_kv_ref(k, v, slots, by_reference)

    written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    written[slots[slots >= 0].long()] = True
    for name, tensor in _page_tensors(by_kernel).items():
        expected = _page_tensors(by_reference)[name]
        num_diff = int((tensor != expected).sum())
        print(f"{precision} B={block_size} {name}: {num_diff} elements differ")
        assert num_diff == 0, f"{name}: {num_diff} elements differ from the reference"
        rows = tensor.flatten(0, 1)  # [num_blocks * B, ...]
        poison = POISON_CODE if tensor.dtype == torch.uint8 else POISON_FLOAT
        assert bool((rows[~written] == poison).all()), f"{name}: a skipped or unused slot was written"
        assert not bool((rows[written] == poison).all()), f"{name}: written slots still hold the poison"


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("precision", ["fp16", "int8", "int4"])
def test_write_kv_matches_reference(precision, block_size, slot_dtype):
    # Bit for bit: kernel and reference do the same float32 steps in the same order
    # with IEEE division, so not even a one-code difference is expected.
    dtype = torch.float16 if DEVICE.type == "cuda" or precision != "fp16" else torch.float32
    _check_write_matches_reference(precision, block_size, 2, 16, dtype, slot_dtype, seed=block_size)


def test_write_kv_fp16_inputs_into_fp16_pages():
    _check_write_matches_reference("fp16", 16, 4, 16, torch.float16, torch.int64, seed=3)


@pytest.mark.parametrize("num_kv_heads,head_dim", [(2, 24), (1, 72)])  # (1, 72): an MLA row in miniature
@pytest.mark.parametrize("precision", ["fp16", "int8", "int4"])
def test_write_kv_head_dims_that_are_not_powers_of_two(precision, num_kv_heads, head_dim):
    # Rows are padded to a power of two inside the kernel: the padding must neither be
    # stored nor enter an INT8/INT4 row's min/max.
    dtype = torch.float16 if DEVICE.type == "cuda" or precision != "fp16" else torch.float32
    _check_write_matches_reference(precision, 8, num_kv_heads, head_dim, dtype, torch.int64, seed=head_dim)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16", "int8", "int4"])
@pytest.mark.parametrize("num_kv_heads", [2, 16])
def test_write_kv_real_shapes_gpu(precision, num_kv_heads):
    _check_write_matches_reference(precision, 16, num_kv_heads, 128, torch.float16, torch.int64, seed=5)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16", "int8", "int4"])
def test_write_kv_latent_shape_gpu(precision):
    # DeepSeek-V2-Lite's MLA row: one KV head of 512 latent + 64 RoPE values.
    _check_write_matches_reference(precision, 16, 1, 576, torch.float16, torch.int64, seed=6)


def _check_window_write_matches_reference(precision, block_size, num_kv_heads, head_dim, dtype, seed):
    # Pages 1 and 4 are kept in FP16: their tokens go to both the codes and the window;
    # the window rows of other pages, and unwritten slots, stay poisoned.
    generator = torch.Generator().manual_seed(seed)
    num_blocks, num_tokens = 6, 30
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(DEVICE, dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(DEVICE, dtype)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[::5] = -1
    slots = slots.to(DEVICE)
    written = []
    for _ in range(2):
        pages = _poisoned_pages(precision, num_blocks, block_size, num_kv_heads, head_dim, dtype)
        pages.window_k = torch.full((3, block_size, num_kv_heads, head_dim), POISON_FLOAT, dtype=dtype, device=DEVICE)
        pages.window_v = pages.window_k.clone()
        pages.window_row = torch.tensor([-1, 2, -1, -1, 0, -1], dtype=torch.int32, device=DEVICE)
        written.append(pages)
    by_kernel, by_reference = written
    write_kv(k, v, slots, by_kernel)
    write_kv_ref(k, v, slots, by_reference)
    for name in ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero", "window_k", "window_v"):
        num_diff = int((getattr(by_kernel, name) != getattr(by_reference, name)).sum())
        print(f"{precision} window {name}: {num_diff} elements differ")
        assert num_diff == 0, f"{name}: {num_diff} elements differ from the reference"
    kept = slots[(slots >= 0) & torch.isin(slots // block_size, torch.tensor([1, 4], device=DEVICE))]
    rows = by_kernel.window_k.flatten(0, 1)  # [3 * B, Hkv, D]
    window_slots = torch.where(kept // block_size == 1, 2, 0) * block_size + kept % block_size
    is_written = torch.zeros(rows.shape[0], dtype=torch.bool, device=DEVICE)
    is_written[window_slots] = True
    assert bool((rows[~is_written] == POISON_FLOAT).all()), "a window row outside the written tokens changed"
    by_slot = {int(s): i for i, s in enumerate(slots.tolist())}
    for slot, window_slot in zip(kept.tolist(), window_slots.tolist()):
        assert torch.equal(rows[window_slot], k[by_slot[slot]].to(dtype)), f"slot {slot}: FP16 copy differs"


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_write_kv_keeps_fp16_copies_of_window_pages(precision):
    _check_window_write_matches_reference(precision, 8, 2, 16, torch.float32, seed=40)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_write_kv_window_real_shapes_gpu(precision):
    _check_window_write_matches_reference(precision, 16, 2, 128, torch.float16, seed=41)


def test_write_kv_rejects_bad_inputs():
    pages = allocate_pages(4, 8, 2, 16, "int8", device=DEVICE)
    k = torch.zeros(3, 2, 16, device=DEVICE)
    slots = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(KernelError, match="slot_mapping"):
        write_kv(k, k, slots.float(), pages)
    with pytest.raises(KernelError, match="k has shape"):
        write_kv(torch.zeros(3, 2, 32, device=DEVICE), k, slots, pages)
    with pytest.raises(KernelError, match="v has dtype"):
        write_kv(k, k.to(torch.int32), slots, pages)
    pages.k_scale = pages.k_scale.float()
    with pytest.raises(KernelError, match="k_scale"):
        write_kv(k, k, slots, pages)
