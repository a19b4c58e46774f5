"""The fast request encoders produce exactly what the Struct encoders produce."""

from __future__ import annotations

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from sidecar.kvcm_client import wire as W

SPEC = W.Spec("full", "event_report://10.0.0.1:8000/hbm?size=4096")
KEYS = st.lists(st.integers(-(2**63), 2**63 - 1), max_size=40, unique=True)


@given(adds=KEYS, deletes=KEYS)
def test_encode_deltas_equals_struct_encoding(adds: list[int], deletes: list[int]) -> None:
    fast = W.encode_deltas("t", "i", "h:1", "ST_EVENT_REPORT_L1P5", adds, deletes, "hbm", SPEC)
    events = [W.ev_add(k, "hbm", SPEC) for k in adds] + [
        W.ev_delete(k, "hbm", "full") for k in deletes
    ]
    slow = W.encode(W.ReportEventRequest("t", "i", "h:1", "ST_EVENT_REPORT_L1P5", events))
    assert fast == slow
    msgspec.json.decode(fast)


@given(keys=KEYS)
def test_encode_snapshot_equals_struct_encoding(keys: list[int]) -> None:
    fast = W.encode_snapshot("t", "i", "h:1", "ST_EVENT_REPORT_L1P5", keys, "hbm", SPEC)
    blocks = [W.SnapshotBlock(str(k), "hbm", [SPEC]) for k in keys]
    slow = W.encode(
        W.ReportEventRequest("t", "i", "h:1", "ST_EVENT_REPORT_L1P5", [W.ev_snapshot(blocks)])
    )
    assert fast == slow
