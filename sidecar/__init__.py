"""kvcm-sidecar: reports an engine's prefix-cache contents to KVCM from a separate process.

This package __init__ stays empty so that `engine_hook` importing `sidecar.shm_ring` loads nothing
heavy (no aiohttp, uvloop or prometheus_client).
"""
