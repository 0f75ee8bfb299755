"""Memory plan, environment probe, OOM diagnosis, crash reports and `lowvram doctor`.
May import: lowvram.models, lowvram.quant, lowvram.kv, lowvram.kernels."""
