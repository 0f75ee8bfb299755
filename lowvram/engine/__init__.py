"""The engine: requests in, tokens out. `LLMEngine.step()` schedules, runs the model and
postprocesses; the model runner turns a scheduled batch into tensors (CUDA graphs, the
sampler), `LLM` and the async engine are the front doors, and the tokenizer detokenizes.

May import: lowvram.core, lowvram.kv, lowvram.models, lowvram.quant, lowvram.memory,
lowvram.kernels.
"""
