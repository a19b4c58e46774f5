"""Replay: what KVCM-aware routing buys, measured on the real stack with a request trace.

Imports: stdlib, aiohttp, msgspec, sidecar (never engine_hook: engines are child processes).
Modules: trace (reader, generator), router (policies), stack (processes), run, report, cli.
"""
