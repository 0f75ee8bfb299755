"""The KV cache: the pool and its backends (`pool`, `tiers`, `managed_memory`, `backend`),
attention over it (`attention`) and saved conversations. May import: lowvram.core, lowvram.kernels."""
