"""The engine's bookkeeping in plain Python (sequences, scheduler, block manager, controller,
spill policy). Imports only the standard library, lowvram.errors and lowvram.config: never torch."""
