"""scripts/lab/half_accumulation_error.py emulates float16 running sums exactly: where every
product and partial sum is exact in float16 it must reproduce the float64 reference, and
where they are not its error must be the float16 rounding it claims to model."""

import torch
from script_modules import load_script

study = load_script("half_accumulation_error")


def test_exact_when_every_partial_sum_fits_float16():
    # small integers: products and running sums of 8 of them are exact in float16
    generator = torch.Generator().manual_seed(1)
    k, n = 256, 16
    centered = torch.randint(-3, 4, (k, n), generator=generator).double()
    x = torch.randint(-4, 5, (k,), generator=generator).half()
    scales = torch.full((k // study.GROUP_SIZE, n), 0.5, dtype=torch.float16)
    ref = (x.double()[:, None] * centered * 0.5).sum(0)
    assert torch.equal(study.half_span_sums(x, centered, scales, 8).double(), ref)


def test_error_is_float16_rounding_of_the_running_sums():
    # x = 1/3 is not exact in float16: one span of 128 ones sums 128 rounded products in float16
    k, n = 128, 1
    centered = torch.ones(k, n, dtype=torch.float64)
    x = torch.full((k,), 1 / 3).half()
    scales = torch.ones(1, n, dtype=torch.float16)
    running = torch.zeros(1, dtype=torch.float16)
    for _ in range(k):
        running = running + x[:1]
    long_span = study.half_span_sums(x, centered, scales, 128)
    short_spans = study.half_span_sums(x, centered, scales, 4)
    assert long_span.item() == running.float().item()
    exact = k * x[0].double().item()
    assert abs(short_spans.item() - exact) < abs(long_span.item() - exact)
