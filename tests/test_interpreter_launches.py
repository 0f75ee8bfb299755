"""CPU tests run kernels in Triton's interpreter, which on its own ignores launch keywords a
kernel does not take; conftest makes it refuse them, as a compiled launch does."""

import os

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter only")


@triton.jit
def _double(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)


def test_a_launch_keyword_the_kernel_does_not_take_is_refused():
    x = torch.arange(4, dtype=torch.float32)
    out = torch.empty_like(x)
    _double[(1,)](x, out, 4, BLOCK=4, num_warps=2)
    assert torch.equal(out, x * 2)
    with pytest.raises(TypeError, match="_double was launched with keywords it does not take: BLOCK_D"):
        _double[(1,)](x, out, 4, BLOCK=4, BLOCK_D=128)
