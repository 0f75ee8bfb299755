"""The engine: requests in, tokens out (engine, model runner, CUDA graphs, sampler, outputs,
the controller's glue in `control`, and the front doors `LLM` and the async engine).
May import lowvram.core, kv, models, quant, memory and kernels."""
