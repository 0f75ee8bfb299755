"""The engine: requests in, tokens out (engine and its controller glue, model runner, CUDA
graphs, sampler, outputs, and the front doors `LLM` and the async engine).
May import lowvram.core, kv, models, quant, memory and kernels."""
