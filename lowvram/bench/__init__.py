"""Benchmarks users run: `lowvram bench speed`, `lowvram bench quality`, and the metadata
every benchmark record carries.

May import: everything but the front ends (server, tui, cli).
"""
