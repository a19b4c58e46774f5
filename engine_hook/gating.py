"""Which ranks publish (the seed's rules): one publisher per data-parallel replica.

Imports: stdlib + descriptor. A gated rank gets a no-op hook and one log line naming the rule.
"""

from __future__ import annotations

from engine_hook.descriptor import Descriptor


def gate_reason(d: Descriptor) -> str | None:
    """None when this rank publishes, else why it does not."""
    if d.publisher_type.strip().lower() == "none":
        return "publisher_type is none"
    if d.tp_rank != 0:
        return f"tp_rank={d.tp_rank}: only tp_rank 0 of each dp replica publishes"
    if d.pp_size != 1:
        return f"pp_size={d.pp_size}: pipeline-parallel KV is not published"
    if d.cp_sharded_kv:
        return "KV cache is sharded across context-parallel ranks"
    if not d.prefix_reuse:
        return "prefix reuse is disabled, so no block can be reused"
    return None
