"""Weight quantization, `lowvram quantize`: the INT4 linear layer (`awq_linear`), the AWQ
search (`awq`), the low-rank residual compensation (`compensation`), the calibration text
(`calibration`), one decoder layer run over it (`layer`), the per-layer pipeline
(`quantize`) and the checkpoint it writes with its FP16-kept layers (`writer`). The AutoAWQ
GEMM layout itself lives with the kernels that read it (`lowvram.kernels.awq_format`).

May import: lowvram.models (quantizing loads a model), lowvram.kernels.
"""
