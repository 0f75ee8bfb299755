"""The fused RoPE + KV-write kernel against its plain-torch reference and against the two
kernels it replaces (apply_rotary, then write_kv).

Without CUDA the kernels run in the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), which rounds every float32 step as torch does, so there the kernel
equals the reference bit for bit. On the GPU the compiler may fuse a multiply and an add
in the rotation (as in apply_rotary), so q and k may differ from the reference by one
rounding; against apply_rotary then write_kv nothing may differ on either.
"""

import pytest
import torch
from dense_paging import hidden_states_through_pages

from lowvram.errors import KernelError
from lowvram.kernels import dispatch
from lowvram.kernels.kv_quant import allocate_pages
from lowvram.kernels.kv_write import rotary_write_kv, rotary_write_kv_ref, write_kv, write_kv_ref
from lowvram.kernels.rotary import apply_rotary
from lowvram.kv import attention
from lowvram.models.dense import Attention

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
IS_EXACT_VS_REFERENCE = DEVICE.type == "cpu"
POISON_CODE = 0xAB
POISON_FLOAT = -77.0
PAGE_NAMES = ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero", "window_k", "window_v")


def test_kernel_path_is_exercised():
    # Without this the kernel-vs-reference tests would compare the reference with itself.
    assert dispatch.use_triton("rotary_write_kv", DEVICE, use_reference=False)


def _tables(num_positions: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(num_positions, dtype=torch.float32), inv_freq).to(DEVICE)  # [P, D/2]
    return freqs.cos(), freqs.sin()


def _pages(precision, num_blocks, block_size, num_kv_heads, head_dim, dtype, has_window):
    pages = allocate_pages(num_blocks, block_size, num_kv_heads, head_dim, precision, dtype=dtype, device=DEVICE)
    for name in PAGE_NAMES[:6]:
        tensor = getattr(pages, name)
        if tensor is not None:
            tensor.fill_(POISON_CODE if tensor.dtype == torch.uint8 else POISON_FLOAT)
    if has_window:
        # Pages 1 and 4 are kept in FP16 as well, in window rows 2 and 0.
        pages.window_k = torch.full((3, block_size, num_kv_heads, head_dim), POISON_FLOAT, dtype=dtype, device=DEVICE)
        pages.window_v = pages.window_k.clone()
        window_row = [-1] * num_blocks
        window_row[1], window_row[4] = 2, 0
        pages.window_row = torch.tensor(window_row, dtype=torch.int32, device=DEVICE)
    return pages


def _split(qkv, num_heads, num_kv_heads, head_dim):
    """q [T, H, D], k and v [T, Hkv, D]: strided views into the fused projection output."""
    q, k, v = qkv.split((num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim), dim=-1)
    num_tokens = qkv.shape[0]
    return (
        q.view(num_tokens, num_heads, head_dim),
        k.view(num_tokens, num_kv_heads, head_dim),
        v.view(num_tokens, num_kv_heads, head_dim),
    )


def _largest_relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def _check_against_reference_and_separate_kernels(
    precision, num_heads, num_kv_heads, head_dim, dtype, *, has_window=False, block_size=8, num_tokens=24, seed=0
):
    generator = torch.Generator().manual_seed(seed)
    num_blocks = 8
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator) * 3.0
    qkv[0] += 20.0  # a one-signed row
    qkv = qkv.to(DEVICE, dtype)
    positions = torch.randint(0, 4096, (num_tokens,), generator=generator)
    positions[:4] = torch.tensor([0, 1, 2, 4095])
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[::7] = -1  # padding rows: rotated like the others, never stored
    positions, slots = positions.to(DEVICE), slots.to(DEVICE)
    cos, sin = _tables(4096, head_dim)

    results = {}
    for path in ("fused", "separate", "reference"):
        buffer = qkv.clone()
        q, k, v = _split(buffer, num_heads, num_kv_heads, head_dim)
        pages = _pages(precision, num_blocks, block_size, num_kv_heads, head_dim, dtype, has_window)
        if path == "fused":
            rotary_write_kv(q, k, v, positions, cos, sin, slots, pages)
        elif path == "separate":
            apply_rotary(q, k, positions, cos, sin)
            write_kv(k, v, slots, pages)
        else:
            rotary_write_kv_ref(q, k, v, positions, cos, sin, slots, pages)
        results[path] = (buffer, pages)
    label = f"{precision} H={num_heads} Hkv={num_kv_heads} D={head_dim} window={has_window}"

    fused_qkv, fused_pages = results["fused"]
    q, k, v = _split(fused_qkv, num_heads, num_kv_heads, head_dim)
    _, _, v_before = _split(qkv, num_heads, num_kv_heads, head_dim)
    assert torch.equal(v, v_before), "v must not be changed"

    # Against apply_rotary then write_kv: the same bytes everywhere.
    separate_qkv, separate_pages = results["separate"]
    assert torch.equal(fused_qkv, separate_qkv), f"{label}: rotated q or k differ from apply_rotary's"
    for name in PAGE_NAMES:
        got, expected = getattr(fused_pages, name), getattr(separate_pages, name)
        if got is not None:
            assert torch.equal(got, expected), f"{label} {name}: differs from apply_rotary then write_kv"

    # Against the plain-torch reference.
    reference_qkv, reference_pages = results["reference"]
    ref_q, ref_k, _ = _split(reference_qkv, num_heads, num_kv_heads, head_dim)
    worst = max(_largest_relative(q, ref_q), _largest_relative(k, ref_k))
    num_page_diffs = sum(
        int((getattr(fused_pages, name) != getattr(reference_pages, name)).sum())
        for name in PAGE_NAMES
        if getattr(fused_pages, name) is not None
    )
    print(f"{label}: largest relative q/k difference {worst:.2e}, {num_page_diffs} page elements differ")
    if IS_EXACT_VS_REFERENCE:
        assert worst == 0.0 and num_page_diffs == 0
    else:
        assert worst <= 1e-3  # one FP16 rounding
    # Whatever k the kernel rotated, the pages hold exactly what the reference stores for it.
    restored = _pages(precision, num_blocks, block_size, num_kv_heads, head_dim, dtype, has_window)
    write_kv_ref(k, v, slots, restored)
    for name in PAGE_NAMES:
        if getattr(restored, name) is not None:
            assert torch.equal(getattr(fused_pages, name), getattr(restored, name)), f"{label} {name}"
    # Skipped slots and unused page rows keep the poison: nothing is written past the slots.
    is_written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    is_written[slots[slots >= 0]] = True
    codes = fused_pages.k.flatten(0, 1)  # [num_blocks * B, Hkv, code_dim]
    poison = POISON_CODE if codes.dtype == torch.uint8 else POISON_FLOAT
    assert bool((codes[~is_written] == poison).all()) and not bool((codes[is_written] == poison).all())


@pytest.mark.parametrize("head_dim", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (6, 2), (4, 4)])
@pytest.mark.parametrize("precision", ["fp16", "int8", "int4"])
def test_rotary_write_kv_matches_reference_and_the_separate_kernels(precision, num_heads, num_kv_heads, head_dim):
    _check_against_reference_and_separate_kernels(
        precision, num_heads, num_kv_heads, head_dim, torch.float16, seed=head_dim + num_heads
    )


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_rotary_write_kv_keeps_fp16_copies_of_window_pages(precision):
    _check_against_reference_and_separate_kernels(precision, 4, 2, 16, torch.float16, has_window=True, seed=3)


def test_rotary_write_kv_in_float32():
    _check_against_reference_and_separate_kernels("int8", 4, 2, 16, torch.float32, seed=4)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "precision,has_window", [("fp16", False), ("int8", False), ("int4", False), ("int8", True), ("int4", True)]
)
def test_rotary_write_kv_at_the_real_shape_gpu(precision, has_window):
    """R1-Distill-Qwen-1.5B: 12 heads and 2 KV heads of 128; a prefill's worth of tokens."""
    _check_against_reference_and_separate_kernels(
        precision, 12, 2, 128, torch.float16, has_window=has_window, block_size=16, num_tokens=100, seed=5
    )


def _attention_forward_rotating_first(self, h, positions, meta, kv_pages):
    """Attention.forward as it was: apply_rotary's kernel, then paged_attention's own KV store."""
    num_tokens = h.shape[0]
    q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
    q, k, v = self.qkv_proj(h).split((q_size, kv_size, kv_size), dim=-1)
    q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, H, D], a view into qkv
    k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
    v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
    self.rotary.reserve(meta.max_context_len, positions.device)
    apply_rotary(q, k, positions, self.rotary.cos, self.rotary.sin)
    out = attention.paged_attention(q, k, v, kv_pages, meta, self.scale)
    return self.o_proj(out.reshape(num_tokens, -1))  # [T, H*D] -> [T, hidden]


@pytest.mark.parametrize("precision", ["fp16", "int4"])
def test_dense_model_through_the_kernels_is_unchanged_by_the_fusion(tiny_qwen2_dir, precision, monkeypatch):
    from lowvram.models.fusion import fuse_projections
    from lowvram.models.loader import load_model

    model, _ = load_model(tiny_qwen2_dir, DEVICE, torch.float16)
    fuse_projections(model)  # q, k and v become strided views of one output, as in the engine
    # The attention kernels also on the CPU (interpreted), not only on CUDA.
    monkeypatch.setattr(attention, "_is_kernel_path", lambda q, head_dim: True)
    prompt, decoded = [1, 17, 5, 33, 2, 9, 60, 4, 12], [7, 3, 21]
    fused = hidden_states_through_pages(model, prompt, decoded, precision)
    monkeypatch.setattr(Attention, "forward", _attention_forward_rotating_first)
    separate = hidden_states_through_pages(model, prompt, decoded, precision)
    num_diff = sum(int((a != b).sum()) for a, b in zip(fused, separate))
    print(f"tiny qwen2 {precision} pages: {num_diff} hidden values differ from rotating in a kernel of its own")
    assert num_diff == 0


def test_rotary_write_kv_rejects_bad_inputs():
    pages = allocate_pages(4, 8, 2, 16, "int8", dtype=torch.float16, device=DEVICE)
    qkv = torch.zeros(3, 8 * 16, dtype=torch.float16, device=DEVICE)
    q, k, v = _split(qkv, 4, 2, 16)
    positions = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    slots = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    cos, sin = _tables(8, 16)
    with pytest.raises(KernelError, match="cos/sin"):
        rotary_write_kv(q, k, v, positions, cos[:, :4].contiguous(), sin[:, :4].contiguous(), slots, pages)
    with pytest.raises(KernelError, match="float32"):
        rotary_write_kv(q, k, v, positions, cos.half(), sin.half(), slots, pages)
    with pytest.raises(KernelError, match="positions"):
        rotary_write_kv(q, k, v, positions[:2], cos, sin, slots, pages)
    with pytest.raises(KernelError, match="rotary_write_kv: v has shape"):
        rotary_write_kv(q, k, q, positions, cos, sin, slots, pages)
    with pytest.raises(KernelError, match="slot_mapping"):
        rotary_write_kv(q, k, v, positions, cos, sin, slots.float(), pages)
    with pytest.raises(KernelError, match="must match"):
        rotary_write_kv(q.float(), k, v, positions, cos, sin, slots, pages)
