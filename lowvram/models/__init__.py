"""Models: the checkpoint's shape (`config`), loading (`loader`), the dense Llama/Qwen2
model, DeepSeek-V2 with its expert cache, the variants chosen when a model is built
(fused projections, batch-invariant kernels, layers streamed from host memory) and the
real shapes with random weights that benchmarks use.

May import: lowvram.kv, lowvram.quant, lowvram.memory, lowvram.kernels.
"""
