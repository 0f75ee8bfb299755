"""Models: checkpoint shape and loading, the dense and DeepSeek-V2 models, the variants chosen when
a model is built, and real shapes with random weights for benchmarks.

May import: lowvram.kv, lowvram.quant, lowvram.memory, lowvram.kernels.
"""
