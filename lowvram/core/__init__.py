"""The engine's bookkeeping in plain Python: requests' state (sequence, sampling
parameters), the scheduler, the block manager, the memory controller and the spill policy.

May import: the standard library, lowvram.errors and lowvram.config. Never torch: these
modules decide, the engine acts, and their tests are exact and run without torch.
"""
