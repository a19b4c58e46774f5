"""A KVCM-compatible event-report server: the stand-in manager for the demo, local runs and tests.

Imports: stdlib, msgspec, aiohttp (and sidecar.keys for token-id queries). See
docs/kvcm_server.md for what is implemented and the conformance table.
"""
