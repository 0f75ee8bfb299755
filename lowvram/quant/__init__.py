"""Weight quantization, `lowvram quantize`: AWQ INT4 (`awq`, `awq_linear`; the layout itself is
`lowvram.kernels.awq_format`), residual `compensation`, `calibration` text, one decoder `layer`
run, the per-layer pipeline (`quantize`) and the checkpoint `writer`.

May import: lowvram.models (quantizing loads a model), lowvram.kernels.
"""

METHODS = ("awq", "rtn")  # `lowvram quantize --method`
