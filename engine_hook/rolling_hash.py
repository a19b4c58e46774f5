"""KVCM's block key (RTP-LLM's rolling hash) for engines: the one implementation lives in
sidecar/shm_ring/rolling_hash.py (engine_hook imports only sidecar.shm_ring); re-exported here.
"""

from __future__ import annotations

from sidecar.shm_ring.rolling_hash import block_keys, roll, to_signed

__all__ = ["block_keys", "roll", "to_signed"]
