"""KVCM client side: msgspec wire structs, the aiohttp client and result classification.

Imports: msgspec, aiohttp. Nothing else in the project builds KVCM JSON by hand.
"""
