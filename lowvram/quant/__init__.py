"""Weight quantization, `lowvram quantize`: the INT4 linear layer, the AWQ search, the
FP16-kept layers, the low-rank residual compensation and the calibration text. The
AutoAWQ GEMM layout itself lives with the kernels that read it (`lowvram.kernels.awq_format`).

May import: lowvram.models (quantizing loads a model), lowvram.kernels.
"""
