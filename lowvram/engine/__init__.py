"""The engine: requests in, tokens out. `LLMEngine.step()` schedules, runs the model and
postprocesses; the model runner turns a scheduled batch into tensors and sampled tokens
(CUDA graphs, the sampler, pipelined decode), `outputs` turns tokens into text and
finished requests, `control` is the engine's side of the memory controller, and `LLM`
and the async engine are the front doors.

May import: lowvram.core, lowvram.kv, lowvram.models, lowvram.quant, lowvram.memory,
lowvram.kernels.
"""
