"""The KV cache: the pool that holds the pages on the device, in CUDA unified memory or
behind a pinned host tier (`pool`, `tiers`, `managed_memory`), attention over them
(`attention`) and conversations saved to disk. The page layouts (FP16, INT8, INT4) and
their plain-torch quantization live with the kernels (`lowvram.kernels.kv_quant`).

May import: lowvram.core, lowvram.kernels.
"""
