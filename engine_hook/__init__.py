"""engine_hook: what an inference engine imports to report its prefix-cache transitions.

Imports: stdlib, numpy, sidecar.shm_ring (optional cupy in block_cache). Never aiohttp, uvloop or
prometheus_client (a test checks in a subprocess). `attach()` never raises unless strict=True: a
gated or misconfigured rank gets a NullHook and one log line saying why.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from engine_hook.descriptor import Descriptor, DescriptorError, build
from engine_hook.gating import gate_reason
from engine_hook.hook import Hook, NullHook
from sidecar.shm_ring import layout
from sidecar.shm_ring.segment import Segment

__all__ = ["Descriptor", "DescriptorError", "Hook", "NullHook", "attach"]

log = logging.getLogger(__name__)


def attach(
    *,
    env: Mapping[str, str] | None = None,
    strict: bool = False,
    start_flusher: bool = True,
    **fields: Any,
) -> Hook | NullHook:
    """Attach this engine replica to its ring, creating the segment if the sidecar has not.

    Keyword fields are the Descriptor's (instance_id, dp_rank, tp_rank, tp_size, dp_size, pp_size,
    model_name, dtype, use_mla, block_size_tokens, group_block_bytes, required_groups, medium, ...);
    any field not given is read from `KV_CACHE_EVENT_<FIELD>` in `env` (default os.environ).
    """
    try:
        d = build(fields, os.environ if env is None else env)
    except DescriptorError as exc:
        if strict:
            raise
        log.error("kvcm hook disabled: invalid config: %s", exc)
        return NullHook(f"invalid config: {exc}")
    reason = gate_reason(d)
    if reason is not None:
        log.info("kvcm hook disabled for this rank: %s", reason)
        return NullHook(reason)
    name = d.ring_name or layout.segment_name(d.instance_id, d.dp_rank)
    try:
        seg = Segment(name, d.ring_capacity_slots or None)
        return Hook(d, seg, start_flusher=start_flusher)
    except Exception as exc:  # attach must not take the engine down
        if strict:
            raise
        log.error("kvcm hook disabled: cannot attach ring %s: %s", name, exc)
        return NullHook(f"cannot attach ring {name}: {exc}")
