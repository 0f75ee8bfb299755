"""The AutoAWQ GEMM layout, written here from its documentation, independent of lowvram's code.

Tests check lowvram's packing and its quantized checkpoints against these routines:

- `qweight` int32 [K, N/8] and `qzeros` int32 [K/G, N/8]: eight 4-bit output columns per
  int32; column j is read by shifting right by 4 * SHIFT_SLOT[j % 8] and keeping 4 bits;
- `scales` float16 [K/G, N]; `bias` float16 [N];
- w[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n];
- config.json `quantization_config`: quant_method "awq", bits 4, group_size, zero_point true,
  version "gemm", modules_to_not_convert.
"""

import json
from pathlib import Path

import torch

SHIFT_SLOT = [0, 4, 1, 5, 2, 6, 3, 7]
AWQ_CONFIG_KEYS = {"quant_method", "bits", "group_size", "zero_point", "version", "modules_to_not_convert"}


def reference_unpack(packed: torch.Tensor) -> torch.Tensor:
    """[K, N/8] int32 -> [K, N] int64, one column at a time, on unsigned 32-bit words."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    num_cols = packed.shape[1] * 8
    columns = [(words[:, j // 8] >> (4 * SHIFT_SLOT[j % 8])) & 0xF for j in range(num_cols)]
    return torch.stack(columns, dim=1)


def reference_dequantize(qweight, qzeros, scales, group_size):
    """W [K, N] (input-major) in float32."""
    q = reference_unpack(qweight).to(torch.float32)
    z = reference_unpack(qzeros).to(torch.float32)
    k = torch.arange(qweight.shape[0])
    return (q - z[k // group_size]) * scales.to(torch.float32)[k // group_size]


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def check_awq_checkpoint(model_dir: Path) -> dict[str, tuple[int, int]]:
    """Assert that model.safetensors and config.json follow the documented layout.

    Returns {layer name: (K, N)} of every INT4 Linear found. Every tensor of the weights
    file must be either one of a quantized Linear's documented tensors or a float16 tensor.
    """
    config = json.loads((Path(model_dir) / "config.json").read_text())
    quant = config["quantization_config"]
    assert set(quant) >= AWQ_CONFIG_KEYS, f"quantization_config lacks {AWQ_CONFIG_KEYS - set(quant)}"
    assert quant["quant_method"] == "awq" and quant["bits"] == 4 and quant["zero_point"] is True
    assert quant["version"] == "gemm"
    assert isinstance(quant["modules_to_not_convert"], list)
    group_size = quant["group_size"]
    assert group_size in (32, 64, 128)

    tensors = read_tensors(Path(model_dir) / "model.safetensors")
    stems = {name[: -len(".qweight")] for name in tensors if name.endswith(".qweight")}
    found = {}
    for stem in stems:
        qweight, qzeros, scales = (tensors[f"{stem}.{attr}"] for attr in ("qweight", "qzeros", "scales"))
        num_inputs, num_packed = qweight.shape
        num_outputs = num_packed * 8
        assert qweight.dtype == torch.int32, stem
        assert qzeros.dtype == torch.int32 and tuple(qzeros.shape) == (num_inputs // group_size, num_packed), stem
        assert scales.dtype == torch.float16 and tuple(scales.shape) == (num_inputs // group_size, num_outputs), stem
        assert num_inputs % group_size == 0, stem
        assert f"{stem}.weight" not in tensors, f"{stem} has both INT4 tensors and an FP16 weight"
        assert not any(fragment in stem for fragment in quant["modules_to_not_convert"]), (
            f"{stem} is quantized but matches modules_to_not_convert"
        )
        zeros = reference_unpack(qzeros)
        assert int(zeros.min()) >= 0 and int(zeros.max()) <= 15
        assert torch.isfinite(reference_dequantize(qweight, qzeros, scales, group_size)).all(), stem
        if f"{stem}.bias" in tensors:
            bias = tensors[f"{stem}.bias"]
            assert bias.dtype == torch.float16 and tuple(bias.shape) == (num_outputs,), stem
        found[stem] = (num_inputs, num_outputs)
    awq_names = {f"{stem}.{attr}" for stem in stems for attr in ("qweight", "qzeros", "scales", "bias")}
    for name, tensor in tensors.items():
        if name not in awq_names:
            assert tensor.dtype == torch.float16, f"{name} is {tensor.dtype}; AWQ checkpoints are float16"
    return found
