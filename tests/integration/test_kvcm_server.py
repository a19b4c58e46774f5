"""Black-box tests of the KVCM-compatible server over HTTP on 127.0.0.1 (port 0).

One behaviour per test, named after it (contract §4 and §12). Liveness uses a fake clock and
short timeouts set through addStorage, so nothing sleeps.
"""

from __future__ import annotations

import asyncio
import gc
import io
import os
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_hook.rolling_hash import block_keys
from sidecar.kvcm_server import proto as P
from sidecar.kvcm_server import report as R
from sidecar.kvcm_server import state as S
from sidecar.kvcm_server.app import KvcmServer

IID = "inst"
HOST = "10.0.0.1:8000"
HEX32 = re.compile(r"[0-9a-f]{32}")


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Api:
    def __init__(self, server: KvcmServer, base: str, session: aiohttp.ClientSession) -> None:
        self.server = server
        self.base = base
        self.session = session

    async def raw(self, route: str, data: bytes) -> tuple[int, Any]:
        async with self.session.post(f"{self.base}/api/{route}", data=io.BytesIO(data)) as resp:
            return resp.status, await resp.json(content_type=None)

    async def __call__(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        async with self.session.post(f"{self.base}/api/{route}", json=body) as resp:
            assert resp.status == 200
            out: dict[str, Any] = await resp.json()
            return out

    async def report(
        self, *events: dict[str, Any], host: str = HOST, storage_type: Any = "ST_EVENT_REPORT_L1P5"
    ) -> dict[str, Any]:
        return await self(
            "reportEvent",
            {
                "trace_id": "t",
                "instance_id": IID,
                "host_ip_port": host,
                "storage_type": storage_type,
                "events": list(events),
            },
        )

    async def visible(self, host: str = HOST) -> list[int]:
        async with self.session.get(f"{self.base}/debug/reporters") as resp:
            data = await resp.json()
        for r in data["reporters"]:
            if r["host_ip_port"] == host:
                return sorted(int(k) for k in r["visible_keys"])
        return []


def code(resp: dict[str, Any]) -> str:
    c: str = resp["header"]["status"]["code"]
    return c


def add(
    key: Any, uri: str = "event_report://h/hbm?size=1", medium: str = "hbm", spec: str = "full"
) -> dict[str, Any]:
    return {
        "event_type": "EVENT_BLOCK_ADD",
        "block_add": {
            "block_key": str(key),
            "medium": medium,
            "specs": [{"name": spec, "uri": uri}],
        },
    }


def delete(key: Any, medium: str = "hbm", spec: str = "full") -> dict[str, Any]:
    return {
        "event_type": "EVENT_BLOCK_DELETE",
        "block_delete": {"block_key": str(key), "medium": medium, "spec_names": [spec]},
    }


def snap(*keys: Any, medium: str = "hbm") -> dict[str, Any]:
    return {
        "event_type": "EVENT_BLOCK_SNAPSHOT",
        "block_snapshot": {
            "blocks": [
                {
                    "block_key": str(k),
                    "medium": medium,
                    "specs": [{"name": "full", "uri": "event_report://h/hbm"}],
                }
                for k in keys
            ]
        },
    }


HEARTBEAT = {"event_type": "EVENT_HEARTBEAT", "heartbeat": {"system_status": {"a": "1"}}}
REGISTER = {"event_type": "EVENT_NODE_REGISTER", "node_register": {"mediums": ["hbm"]}}
HOST_DOWN = {"event_type": "EVENT_HOST_DOWN", "host_down": {}}
REG: dict[str, Any] = {
    "trace_id": "t",
    "instance_group": "default",
    "instance_id": IID,
    "block_size": 4,
    "location_spec_infos": [{"name": "full", "size": 1024}],
    "model_deployment": {"model_name": "m", "dtype": "fp16", "tp_size": 1},
    "location_spec_groups": [{"name": "default", "spec_names": ["full"]}],
}


async def start(server: KvcmServer, session: aiohttp.ClientSession) -> tuple[Api, web.AppRunner]:
    runner = web.AppRunner(server.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return Api(server, f"http://127.0.0.1:{port}", session), runner


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def api(clock: FakeClock) -> AsyncIterator[Api]:
    server = KvcmServer(
        clock=clock,
        bootstrap=True,
        max_body=1 << 20,
        event_report={
            "heartbeat_timeout_ms": 200,
            "cleanup_grace_ms": 1000,
            "snapshot_min_interval_ms": 500,
            "snapshot_delta_drain_timeout_ms": 2000,
        },
    )
    async with aiohttp.ClientSession() as session:
        a, runner = await start(server, session)
        assert code(await a("registerInstance", REG)) == "OK"
        yield a
        await runner.cleanup()


# ---- registerInstance -------------------------------------------------------------------
async def test_register_instance_identical_again_is_ok(api: Api) -> None:
    assert code(await api("registerInstance", REG)) == "OK"


async def test_register_instance_mismatch_is_duplicate_entity_naming_fields(api: Api) -> None:
    resp = await api("registerInstance", {**REG, "block_size": 8})
    assert code(resp) == "DUPLICATE_ENTITY"
    assert "block_size" in resp["header"]["status"]["message"]


async def test_register_instance_unknown_group_is_instance_not_exist(api: Api) -> None:
    resp = await api("registerInstance", {**REG, "instance_id": "x", "instance_group": "nope"})
    assert code(resp) == "INSTANCE_NOT_EXIST"


async def test_register_instance_missing_model_name_is_invalid_argument(api: Api) -> None:
    resp = await api("registerInstance", {**REG, "instance_id": "y", "model_deployment": {}})
    assert code(resp) == "INVALID_ARGUMENT"


async def test_register_instance_user_data_excluded_from_identity(api: Api) -> None:
    md = {**REG["model_deployment"], "user_data": "anything"}
    assert code(await api("registerInstance", {**REG, "model_deployment": md})) == "OK"


# ---- reportEvent: envelope and encoding -------------------------------------------------
async def test_report_empty_events_is_ok_noop(api: Api) -> None:
    resp = await api.report()
    assert code(resp) == "OK" and resp["retry_after_ms"] == "0"
    assert "extra_info" in resp and await api.visible() == []


async def test_report_unparseable_body_is_http_400_empty(api: Api) -> None:
    assert await api.raw("reportEvent", b"{not json") == (400, {})


async def test_report_oversize_body_is_http_413(api: Api) -> None:
    status, _ = await api.raw("reportEvent", b'{"x":"' + b"a" * (2 << 20) + b'"}')
    assert status == 413


async def test_report_deep_nesting_is_http_400(api: Api) -> None:
    assert (await api.raw("reportEvent", b"[" * 200 + b"]" * 200))[0] == 400
    assert (await api.raw("reportEvent", b'{"a":' * 100 + b"1" + b"}" * 100))[0] == 400


async def test_report_camel_case_keys_and_numeric_enums_accepted(api: Api) -> None:
    resp = await api(
        "reportEvent",
        {
            "traceId": "t",
            "instanceId": IID,
            "hostIpPort": HOST,
            "storageType": 7,
            "events": [
                {
                    "eventType": 2,
                    "blockAdd": {
                        "blockKey": "5",
                        "medium": "hbm",
                        "specs": [{"name": "full", "uri": "x://h"}],
                    },
                }
            ],
        },
    )
    assert code(resp) == "OK" and await api.visible() == [5]


async def test_report_missing_storage_type_is_invalid_argument(api: Api) -> None:
    assert code(await api.report(add(1), storage_type=None)) == "INVALID_ARGUMENT"


async def test_report_host_with_hash_is_invalid_argument(api: Api) -> None:
    assert code(await api.report(add(1), host="a#b")) == "INVALID_ARGUMENT"


async def test_report_unknown_instance_is_instance_not_exist(api: Api) -> None:
    resp = await api(
        "reportEvent",
        {
            "instance_id": "ghost",
            "host_ip_port": HOST,
            "storage_type": "ST_EVENT_REPORT_L1P5",
            "events": [add(1)],
        },
    )
    assert code(resp) == "INSTANCE_NOT_EXIST"


# ---- generations and visibility ---------------------------------------------------------
async def test_report_first_delta_snapshot_required_then_not(api: Api) -> None:
    assert (await api.report(add(1)))["snapshot_required"] is True
    assert (await api.report(add(2)))["snapshot_required"] is False


async def test_report_add_uri_gets_one_s_version(api: Api) -> None:
    await api.report(add(7, uri="event_report://h/hbm?size=1"))
    loc = await api(
        "getCacheLocation", {"instance_id": IID, "query_type": "QT_BATCH_GET", "block_keys": [7]}
    )
    uri = loc["locations"][0]["location_specs"][0]["uri"]
    assert re.fullmatch(r"event_report://h/hbm\?size=1&s_version=[0-9a-f]{32}", uri)


async def test_report_unsigned_and_signed_text_are_same_key(api: Api) -> None:
    await api.report(add("18446744073709551615"))
    await api.report(delete("-1"))
    assert await api.visible() == []


async def test_report_leading_zeros_canonicalised(api: Api) -> None:
    await api.report(add("0042"))
    await api.report(add("0" * 30 + "43"))  # longer than 20 digits, still key 43
    await api.report(add("18446744073709551615"))  # u64 max: the int64 -1
    assert await api.visible() == [-1, 42, 43]


@pytest.mark.parametrize(
    "bad", ["+1", " 1", "1 ", "18446744073709551616", "abc", "", 5, "9" * 5000, "-" + "9" * 5000]
)
async def test_report_bad_block_key_is_item_invalid_argument(api: Api, bad: Any) -> None:
    ev = add(1)
    ev["block_add"]["block_key"] = bad
    resp = await api.report(ev)
    assert resp["item_results"] == ["INVALID_ARGUMENT"] and code(resp) == "INVALID_ARGUMENT"


@pytest.mark.parametrize(
    "mutate",
    [
        lambda e: e["block_add"].pop("specs"),
        lambda e: e["block_add"]["specs"].append(dict(e["block_add"]["specs"][0])),
        lambda e: e["block_add"]["specs"][0].update(uri="not-a-uri"),
        lambda e: e["block_add"]["specs"][0].update(uri="x://h?s_version=" + "0" * 32),
        lambda e: e["block_add"].update(medium="h#m"),
        lambda e: e.pop("block_add"),
        lambda e: e.update(event_type="EVENT_NO_SUCH"),
    ],
)
async def test_report_item_error_at_its_index_others_apply(api: Api, mutate: Any) -> None:
    bad = add(2)
    mutate(bad)
    resp = await api.report(add(1), bad, add(3))
    assert resp["item_results"] == ["OK", "INVALID_ARGUMENT", "OK"]
    assert code(resp) == "INVALID_ARGUMENT"
    assert await api.visible() == [1, 3]


async def test_report_large_mixed_request_keeps_alignment(api: Api) -> None:
    events = [add(i) if i % 7 else delete(i, spec="") for i in range(512)]
    resp = await api.report(*events)
    assert resp["item_results"] == ["OK" if i % 7 else "INVALID_ARGUMENT" for i in range(512)]
    assert await api.visible() == [i for i in range(512) if i % 7]


async def test_report_empty_spec_names_is_item_error(api: Api) -> None:
    ev = delete(1)
    ev["block_delete"]["spec_names"] = []
    assert (await api.report(ev))["item_results"] == ["INVALID_ARGUMENT"]


async def test_report_last_operation_wins_within_request(api: Api) -> None:
    await api.report(add(1, uri="a://1"), delete(1), add(1, uri="b://2"), add(2), delete(2))
    loc = await api(
        "getCacheLocation",
        {"instance_id": IID, "query_type": "QT_BATCH_GET", "block_keys": ["1", 2]},
    )
    assert loc["locations"][0]["location_specs"][0]["uri"].startswith("b://2?s_version=")
    assert loc["locations"][1]["location_specs"] == []


async def test_report_delete_of_missing_key_is_ok(api: Api) -> None:
    assert code(await api.report(delete(999))) == "OK"


async def test_report_invalid_only_first_delta_creates_no_reporter(api: Api) -> None:
    await api.report(add("bad"))
    assert (await api.report(add(1)))["snapshot_required"] is True


# ---- request-shape errors: no side effects, no item_results ------------------------------
@pytest.mark.parametrize(
    "events",
    [[snap(1), add(2)], [snap(1), snap(2)], [HOST_DOWN, HEARTBEAT], [add(1), HOST_DOWN]],
)
async def test_report_request_shape_error_has_no_side_effects(api: Api, events: list[Any]) -> None:
    await api.report(add(9))
    resp = await api.report(*events)
    assert code(resp) == "INVALID_ARGUMENT" and "item_results" not in resp
    assert await api.visible() == [9]


# ---- HOST_DOWN and tombstones ------------------------------------------------------------
async def test_host_down_hides_at_once_then_node_not_registered(api: Api) -> None:
    await api.report(add(1))
    assert code(await api.report(HOST_DOWN)) == "OK"
    assert await api.visible() == []
    assert code(await api.report(add(2))) == "NODE_NOT_REGISTERED"


async def test_register_revives_tombstone_with_empty_generation(api: Api) -> None:
    await api.report(add(1))
    await api.report(HOST_DOWN)
    resp = await api.report(REGISTER, add(2))
    assert code(resp) == "OK" and resp["snapshot_required"] is True
    assert await api.visible() == [2]


async def test_register_on_live_reporter_keeps_generation(api: Api) -> None:
    await api.report(add(1))
    resp = await api.report(REGISTER)
    assert resp["snapshot_required"] is False and await api.visible() == [1]


# ---- snapshots ---------------------------------------------------------------------------
async def test_snapshot_commit_hides_omitted_blocks_at_once(api: Api) -> None:
    await api.report(add(1), add(2), add(3))
    resp = await api.report(snap(2, 4))
    assert code(resp) == "OK" and HEX32.fullmatch(resp["committed_snapshot_version"])
    assert await api.visible() == [2, 4]


async def test_snapshot_leaves_other_reporters_blocks_of_the_instance_alone(api: Api) -> None:
    await api.report(add(1), add(2), host="10.0.0.2:8000")
    await api.report(add(2), add(3))
    await api.report(snap(4))  # HOST's snapshot: its 2 and 3 go, the other host's stay
    assert await api.visible() == [4]
    assert await api.visible("10.0.0.2:8000") == [1, 2]


async def test_snapshot_later_deltas_visible_with_committed_version(api: Api) -> None:
    v = (await api.report(snap(1)))["committed_snapshot_version"]
    await api.report(add(5))
    loc = await api(
        "getCacheLocation", {"instance_id": IID, "block_keys": [5], "query_type": "QT_BATCH_GET"}
    )
    assert loc["locations"][0]["location_specs"][0]["uri"].endswith("s_version=" + v)
    assert await api.visible() == [1, 5]


async def test_snapshot_empty_blocks_clears_reporter(api: Api) -> None:
    await api.report(add(1), add(2))
    await api.report(snap())
    assert await api.visible() == []


async def test_snapshot_duplicate_key_after_canonicalisation_rejected(api: Api) -> None:
    resp = await api.report(snap("42", "0042"))
    assert code(resp) == "INVALID_ARGUMENT" and resp["item_results"] == ["INVALID_ARGUMENT"]


async def test_snapshot_rate_limited_with_retry_after(api: Api, clock: FakeClock) -> None:
    v = (await api.report(snap(1)))["committed_snapshot_version"]
    resp = await api.report(snap(2))
    assert code(resp) == "SNAPSHOT_RATE_LIMITED"
    assert 0 < int(resp["retry_after_ms"]) <= 500
    assert resp["committed_snapshot_version"] == v
    clock.t += 0.6
    assert code(await api.report(snap(2))) == "OK"


async def test_snapshot_rate_limit_reset_by_register(api: Api) -> None:
    await api.report(snap(1))
    await api.report(REGISTER)
    assert code(await api.report(snap(2))) == "OK"


async def test_concurrent_snapshots_exactly_one_commits(api: Api) -> None:
    api.server.report.commit_delay_s = 0.05
    a, b = await asyncio.gather(api.report(snap(1)), api.report(snap(2)))
    codes = sorted([code(a), code(b)])
    assert codes[0] == "OK" and codes[1] in ("SNAPSHOT_IN_PROGRESS", "SNAPSHOT_RATE_LIMITED")


async def test_concurrent_first_deltas_exactly_one_snapshot_required(api: Api) -> None:
    rs = await asyncio.gather(*(api.report(add(i)) for i in range(8)))
    assert sum(r["snapshot_required"] for r in rs) == 1


async def test_deltas_during_slow_snapshot_wait_then_apply_after_it(api: Api) -> None:
    api.server.report.commit_delay_s = 0.1
    s = asyncio.create_task(api.report(snap(1)))
    async with asyncio.timeout(5):
        await api.server.report.snapshot_started.wait()
    d = await api.report(add(2))
    assert code(d) == "OK" and code(await s) == "OK"
    assert await api.visible() == [1, 2]  # the delta was applied after the commit


async def test_deltas_time_out_with_snapshot_in_progress(clock: FakeClock) -> None:
    server = KvcmServer(
        clock=clock, bootstrap=True, event_report={"snapshot_delta_drain_timeout_ms": 20}
    )
    async with aiohttp.ClientSession() as session:
        api, runner = await start(server, session)
        await api("registerInstance", REG)
        server.report.commit_delay_s = 0.5
        s = asyncio.create_task(api.report(snap(1)))
        async with asyncio.timeout(5):
            await server.report.snapshot_started.wait()
        assert code(await api.report(add(2))) == "SNAPSHOT_IN_PROGRESS"
        await s
        await runner.cleanup()


# ---- liveness (fake clock) -----------------------------------------------------------------
async def test_heartbeat_timeout_hides_then_heartbeat_restores(api: Api, clock: FakeClock) -> None:
    await api.report(add(1), HEARTBEAT)
    clock.t += 0.3
    assert await api.visible() == []
    resp = await api.report(HEARTBEAT)
    assert resp["snapshot_required"] is False and await api.visible() == [1]


async def test_data_events_do_not_refresh_liveness(api: Api, clock: FakeClock) -> None:
    await api.report(add(1), HEARTBEAT)
    clock.t += 0.15
    await api.report(add(2))
    clock.t += 0.1
    assert await api.visible() == []


async def test_writes_accepted_while_unavailable(api: Api, clock: FakeClock) -> None:
    await api.report(HEARTBEAT)
    clock.t += 0.3
    assert code(await api.report(add(3))) == "OK"
    await api.report(HEARTBEAT)
    assert await api.visible() == [3]


async def test_cleanup_grace_tombstones_reporter(api: Api, clock: FakeClock) -> None:
    await api.report(add(1), HEARTBEAT)
    clock.t += 1.5
    assert code(await api.report(HEARTBEAT)) == "NODE_NOT_REGISTERED"
    assert code(await api.report(REGISTER, HEARTBEAT)) == "OK"
    assert await api.visible() == []


async def test_heartbeat_system_status_visible_in_debug_view(api: Api) -> None:
    await api.report(HEARTBEAT)
    async with api.session.get(f"{api.base}/debug/reporters") as resp:
        data = await resp.json()
    assert data["reporters"][0]["system_status"] == {"a": "1"}


# ---- queries -----------------------------------------------------------------------------
async def test_get_cache_location_by_token_ids_uses_rolling_hash(api: Api) -> None:
    tokens = list(range(12))
    keys = block_keys(tokens, 4)
    await api.report(add(keys[0]), add(keys[1]))
    loc = await api(
        "getCacheLocation",
        {"instance_id": IID, "query_type": "QT_PREFIX_MATCH", "token_ids": tokens},
    )
    assert len(loc["locations"]) == 2


async def test_get_host_cache_state_per_host_prefix_sorted(api: Api) -> None:
    await api.report(add(1), add(2), add(3), host="b:1")
    await api.report(add(1), host="a:1")
    await api.report(add(2), host="c:1")  # no prefix: omitted
    resp = await api(
        "getHostCacheState",
        {"instance_id": IID, "query_type": "QT_PREFIX_MATCH", "block_cache_keys": [1, 2, 3]},
    )
    assert [(h["host_ip_port"], h["local"]) for h in resp["hosts"]] == [("a:1", "1"), ("b:1", "3")]


async def test_get_host_cache_state_rejects_batch_get(api: Api) -> None:
    resp = await api(
        "getHostCacheState",
        {"instance_id": IID, "query_type": "QT_BATCH_GET", "block_cache_keys": [1]},
    )
    assert code(resp) == "INVALID_ARGUMENT"


# ---- restart ------------------------------------------------------------------------------
async def test_restart_with_state_file_restores_blocks_after_first_event(
    tmp_path: Path, clock: FakeClock
) -> None:
    sf = tmp_path / "kvcm.json"
    async with aiohttp.ClientSession() as session:
        server = KvcmServer(clock=clock, bootstrap=True, state_file=sf)
        api, runner = await start(server, session)
        await api("registerInstance", REG)
        old = (await api.report(snap(1, 2)))["committed_snapshot_version"]
        await runner.cleanup()  # saves the state file

        server2 = KvcmServer(clock=clock, bootstrap=True, state_file=sf)
        api2, runner2 = await start(server2, session)
        assert code(await api2("registerInstance", REG)) == "OK"  # the instance persisted
        loc = await api2(
            "getCacheLocation",
            {"instance_id": IID, "block_keys": [1], "query_type": "QT_BATCH_GET"},
        )
        assert loc["locations"][0]["location_specs"] == []  # hidden: reporter unknown
        first = await api2.report(HEARTBEAT)
        assert first["snapshot_required"] is True and first["committed_snapshot_version"] == ""
        loc = await api2(
            "getCacheLocation",
            {"instance_id": IID, "block_keys": [1], "query_type": "QT_BATCH_GET"},
        )
        assert loc["locations"][0]["location_specs"][0]["uri"].endswith(old)
        new = (await api2.report(snap(1)))["committed_snapshot_version"]
        assert HEX32.fullmatch(new) and new != old
        assert await api2.visible() == [1]
        assert await _stored_versions(api2) == [new]  # block 2 (restored, omitted) is gone
        await runner2.cleanup()


async def _stored_versions(api: Api, host: str = HOST) -> list[str]:
    async with api.session.get(f"{api.base}/debug/reporters") as resp:
        data = await resp.json()
    out: list[str] = next(
        r["stored_versions"] for r in data["reporters"] if r["host_ip_port"] == host
    )
    return out


# ---- hostile input ---------------------------------------------------------------------------
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=8),
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=12), kids, max_size=4)
    ),
    max_leaves=20,
)
FIELDS = st.sampled_from(
    [
        "instance_id",
        "host_ip_port",
        "storage_type",
        "events",
        "event_type",
        "block_add",
        "block_key",
        "specs",
        "medium",
        "block_snapshot",
        "blocks",
        "spec_names",
        "heartbeat",
    ]
)


def _fuzz(examples: int) -> settings:
    """Hypothesis settings for tests that also take (function-scoped) server fixtures."""
    return settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture],
    )


def _mutated_request(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = {
        "instance_id": IID,
        "host_ip_port": "fuzz:1",
        "storage_type": "ST_EVENT_REPORT_L1P5",
        "events": [add(draw(st.integers(0, 9))), snap(1)],
    }
    path: Any = body
    for _ in range(draw(st.integers(1, 3))):
        key = draw(FIELDS)
        if isinstance(path, dict):
            path[key] = draw(JSON)
            nxt = path.get(key)
            if isinstance(nxt, (dict, list)):
                path = nxt
        elif isinstance(path, list) and path:
            path[0] = draw(JSON)
    return body


@_fuzz(150)
@given(data=st.data())
async def test_report_hostile_bodies_never_500_and_never_touch_other_reporters(
    api: Api, data: st.DataObject
) -> None:
    await api.report(add(77))  # an innocent reporter on HOST
    body = data.draw(st.composite(_mutated_request)())
    status, _ = await api.raw("reportEvent", msgspec.json.encode(body))
    assert status in (200, 400)
    assert await api.visible() == [77]


async def test_liveness_configured_through_add_storage_route(clock: FakeClock) -> None:
    """Operators' path: addStorage with short timeouts, a group, register, then liveness."""
    server = KvcmServer(clock=clock)
    async with aiohttp.ClientSession() as session:
        api, runner = await start(server, session)
        st = {
            "storage": {
                "global_unique_name": "fast",
                "storage_type": "ST_EVENT_REPORT_L1P5",
                "event_report": {"heartbeat_timeout_ms": 100, "cleanup_grace_ms": 400},
            }
        }
        assert code(await api("addStorage", st)) == "OK"
        assert code(await api("addStorage", st)) == "DUPLICATE_ENTITY"
        grp = {"instance_group": {"name": "default", "event_report_storage_candidates": ["fast"]}}
        assert code(await api("createInstanceGroup", grp)) == "OK"
        listed = await api("listStorage", {})
        assert listed["storages"][0]["event_report"]["heartbeat_timeout_ms"] == 100
        assert code(await api("registerInstance", REG)) == "OK"
        await api.report(add(1), HEARTBEAT)
        clock.t += 0.15
        assert await api.visible() == []  # past the 100 ms timeout: hidden
        await api.report(HEARTBEAT)
        assert await api.visible() == [1]  # within grace: restored
        upd = {
            "storage": {
                **st["storage"],
                "event_report": {"heartbeat_timeout_ms": 1000, "cleanup_grace_ms": 5000},
            }
        }
        assert code(await api("updateStorage", upd)) == "OK"
        clock.t += 0.5
        assert await api.visible() == [1]  # the new timeout applies
        await runner.cleanup()


# ---- the typed fast path and the dict path answer alike ------------------------------------


KEY_TEXT = st.one_of(
    st.integers(0, 5).map(str),
    st.integers(0, 5).map(lambda k: f"000{k}"),  # leading zeros are the same key
    st.sampled_from(["18446744073709551615", "9223372036854775808", "-3", "1" * 21, "+1", "x"]),
)
MEDIUM = st.sampled_from(["hbm", "dram", "", "a#b"])
URI = st.sampled_from(["event_report://h/a", "event_report://h/b?x=1", "bad", "e://s_version=1"])


def _event(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(["add", "add", "delete", 2, 3]))
    key, medium = draw(KEY_TEXT), draw(MEDIUM)
    names = draw(st.sampled_from([["full"], ["full", "other"], [], [""]]))
    if kind in ("add", 2):
        specs = [{"name": n or "full", "uri": draw(URI)} for n in names[:1] or ["full"]]
        body = {"block_key": key, "medium": medium, "specs": specs}
        return {"event_type": "EVENT_BLOCK_ADD" if kind == "add" else 2, "block_add": body}
    body = {"block_key": key, "medium": medium, "spec_names": names}
    return {"event_type": "EVENT_BLOCK_DELETE" if kind == "delete" else 3, "block_delete": body}


def _publisher_request(draw: st.DrawFn) -> list[dict[str, Any]]:
    """A publisher's shape: ADDs sharing one medium and spec list, then DELETEs sharing one
    medium and spec-name list (sometimes with an odd item in either run, which must not change
    any answer)."""
    medium, uri = draw(MEDIUM), draw(URI)
    specs = [{"name": "full", "uri": uri}]
    if draw(st.booleans()):  # a second spec: a DELETE of one of them leaves the other
        specs.append({"name": "other", "uri": draw(URI)})
    adds = [
        {
            "event_type": "EVENT_BLOCK_ADD",
            "block_add": {"block_key": k, "medium": medium, "specs": specs},
        }
        for k in draw(st.lists(KEY_TEXT, min_size=1, max_size=6))
    ]
    if draw(st.booleans()):
        adds.insert(draw(st.integers(0, len(adds))), draw(st.composite(_event)()))
    names = draw(st.sampled_from([["full"], ["full", "other"], ["other"]]))
    deletes = [
        {
            "event_type": "EVENT_BLOCK_DELETE",
            "block_delete": {"block_key": k, "medium": medium, "spec_names": names},
        }
        for k in draw(st.lists(KEY_TEXT, max_size=4))
    ]
    odd: bool = draw(st.booleans())
    if deletes and odd:
        deletes.insert(draw(st.integers(0, len(deletes))), draw(st.composite(_event)()))
    return adds + deletes


def _typed_request(draw: st.DrawFn) -> list[dict[str, Any]]:
    if draw(st.booleans()):
        return draw(st.composite(_publisher_request)())
    if draw(st.integers(0, 4)) == 0:
        keys = draw(st.lists(KEY_TEXT, max_size=4))
        blocks = [
            {"block_key": k, "medium": draw(MEDIUM), "specs": [{"name": "full", "uri": draw(URI)}]}
            for k in keys
        ]
        return [{"event_type": "EVENT_BLOCK_SNAPSHOT", "block_snapshot": {"blocks": blocks}}]
    return [draw(st.composite(_event)()) for _ in range(draw(st.integers(1, 5)))]


def _state_view(server: KvcmServer) -> dict[str, Any]:
    """Block metadata with generation versions replaced by their order of appearance."""
    versions: dict[str, str] = {}

    def norm(uri: str) -> str:
        head, _, v = uri.partition("s_version=")
        return head + "v" + versions.setdefault(v, str(len(versions)))

    return {
        iid: {
            k: {loc: {n: norm(u) for n, u in sorted(sp)} for loc, sp in sorted(ls.items())}
            for k, ls in sorted(keys.items())
        }
        for iid, keys in server.state.blocks.items()
        if keys
    }


@_fuzz(60)
@given(data=st.data())
async def test_report_typed_fast_path_answers_exactly_as_the_dict_path(
    clock: FakeClock, data: st.DataObject
) -> None:
    er = {"snapshot_min_interval_ms": 0}
    fast, slow = (KvcmServer(clock=clock, bootstrap=True, event_report=er) for _ in range(2))
    async with aiohttp.ClientSession() as session:
        (a, ra), (b, rb) = [await start(s, session) for s in (fast, slow)]
        try:
            await _compare_paths(a, b, data)
        finally:
            await ra.cleanup()
            await rb.cleanup()
    assert _state_view(fast) == _state_view(slow)
    assert fast.state.arrival_times(HOST) == slow.state.arrival_times(HOST)


async def _compare_paths(a: Api, b: Api, data: st.DataObject) -> None:
    typed_seen = 0
    for x in (a, b):
        assert code(await x("registerInstance", REG)) == "OK"
    for _ in range(data.draw(st.integers(1, 6))):
        events = data.draw(st.composite(_typed_request)())
        body = {
            "trace_id": "t",
            "instance_id": IID,
            "host_ip_port": HOST,
            "storage_type": "ST_EVENT_REPORT_L1P5",
            "events": events,
        }
        raw = msgspec.json.encode(body)
        typed_seen += P.decode_report(raw) is not None
        st_a, resp_a = await a.raw("reportEvent", raw)
        st_b, resp_b = await b.raw("reportEvent", msgspec.json.encode(P.camel(body)))
        assert st_a == st_b
        for resp in (resp_a, resp_b):
            if resp.get("committed_snapshot_version"):
                resp["committed_snapshot_version"] = "V"
        assert resp_a == resp_b
    assert await a.visible() == await b.visible()
    assert typed_seen  # the property is about the typed path: it must have been taken


async def test_a_publisher_batch_of_adds_is_applied_as_one_run(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The usual body (ADDs sharing medium and specs, then DELETEs) takes the one-run path and
    records each key's arrival; an odd item in the run sends it item by item with the same
    outcome (the property test above compares every answer with the dict path)."""
    calls: list[list[int]] = []
    add_keys = R._Puts.add_keys

    def spy(self: R._Puts, keys: Any, *rest: Any) -> None:
        calls.append(list(keys))
        add_keys(self, keys, *rest)

    monkeypatch.setattr(R._Puts, "add_keys", spy)
    assert code(await api("registerInstance", REG)) == "OK"
    assert code(await api.report(add(1), add("0002"), add(18446744073709551615), delete(1))) == "OK"
    assert calls == [[1, 2, -1]]
    assert await api.visible() == [-1, 2]
    calls.clear()
    resp = await api.report(add(3), add("x"), add(4))
    assert resp["item_results"] == ["OK", "INVALID_ARGUMENT", "OK"]
    assert calls == [[3], [4]]
    assert await api.visible() == [-1, 2, 3, 4]
    times = api.server.state.arrival_times(HOST)
    assert set(times) == {-1, 1, 2, 3, 4} and all(len(t) == 1 for t in times.values())


# ---- the stepwise state saver ----------------------------------------------------------------
def _blocks(state: S.State) -> dict[str, dict[int, dict[Any, Any]]]:
    return {iid: {k: dict(ls) for k, ls in keys.items()} for iid, keys in state.blocks.items()}


async def _report_random(api: Api, data: st.DataObject, n: int) -> None:
    for _ in range(n):
        body = {
            "trace_id": "t",
            "instance_id": IID,
            "host_ip_port": data.draw(st.sampled_from([HOST, "10.0.0.2:8000"])),
            "storage_type": "ST_EVENT_REPORT_L1P5",
            "events": data.draw(st.composite(_typed_request)()),
        }
        await api.raw("reportEvent", msgspec.json.encode(body))


@_fuzz(40)
@given(data=st.data())
async def test_stepwise_save_writes_the_state_as_it_was_when_it_started(
    tmp_path: Path, clock: FakeClock, data: st.DataObject, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The saver yields to the event loop between pieces while requests keep changing blocks
    (adds, deletes, snapshots that drop omitted blocks): the file must hold exactly the blocks
    of the moment the save started, in the form a restarted server loads."""
    monkeypatch.setattr(S, "SAVE_STEP", 1)  # a yield after every block
    sf = tmp_path / f"kvcm-{data.draw(st.uuids())}.json"
    # No state file of its own: the server's periodic saver must not write while this runs.
    server = KvcmServer(clock=clock, bootstrap=True, event_report={"snapshot_min_interval_ms": 0})
    async with aiohttp.ClientSession() as session:
        api, runner = await start(server, session)
        try:
            await api("registerInstance", REG)
            await _report_random(api, data, data.draw(st.integers(1, 4)))
            before = _blocks(server.state)
            server.state.state_file = sf
            steps = server.state.save_steps()
            next(steps, None)  # started: this is the moment saved
            assert not _dirty(server)
            server.state.state_file = None
            await _report_random(api, data, data.draw(st.integers(1, 4)))
            for _ in steps:
                pass
        finally:
            await runner.cleanup()
    assert _blocks(S.State(clock, sf)) == before


def _dirty(server: KvcmServer) -> bool:
    """Read through a call: mypy would keep the attribute narrowed across close()."""
    return server.state.dirty


async def test_abandoned_save_keeps_the_state_dirty(tmp_path: Path, clock: FakeClock) -> None:
    server = KvcmServer(clock=clock, bootstrap=True)  # no periodic saver writing meanwhile
    async with aiohttp.ClientSession() as session:
        api, runner = await start(server, session)
        try:
            await api("registerInstance", REG)
            await api.report(add(1), add(2))
            server.state.state_file = tmp_path / "kvcm.json"
            steps = server.state.save_steps()
            next(steps, None)
            assert not _dirty(server)
            steps.close()  # cancelled mid-save (shutdown): nothing was written
            assert _dirty(server)
            assert os.listdir(tmp_path) == []  # no partial file left behind
            server.state.state_file = None
        finally:
            await runner.cleanup()


async def test_block_entries_are_invisible_to_the_garbage_collector(
    tmp_path: Path, clock: FakeClock
) -> None:
    """Millions of block entries must cost full collections nothing: every entry written by
    publisher-shaped requests, snapshots, deletes, or a restart from the state file holds only
    untracked tuples, so CPython never tracks it."""
    sf = tmp_path / "kvcm.json"
    server = KvcmServer(clock=clock, bootstrap=True, state_file=sf)
    async with aiohttp.ClientSession() as session:
        api, runner = await start(server, session)
        try:
            await api("registerInstance", REG)
            for host in (HOST, "10.0.0.2:8000"):
                assert code(await api.report(*(add(k) for k in range(1, 40)), host=host)) == "OK"
            assert code(await api.report(snap(*range(1, 30)))) == "OK"
            assert code(await api.report(delete(2), delete(3), host="10.0.0.2:8000")) == "OK"
            live = list(server.state.blocks[IID].values())
            assert live and not [e for e in live if gc.is_tracked(e)]
        finally:
            await runner.cleanup()  # writes the state file
    restored = list(S.State(clock, sf).blocks[IID].values())
    assert len(restored) == len(live) and not [e for e in restored if gc.is_tracked(e)]


async def test_a_publisher_batch_of_deletes_removes_only_the_named_specs(api: Api) -> None:
    """The one-run DELETE path: a delete of one spec name keeps the block's other specs, a
    delete of every name removes the block, an absent block is a no-op; the same in
    lowerCamelCase (the item-by-item dict path)."""
    two = [
        {"name": "full", "uri": "event_report://h/a"},
        {"name": "swa", "uri": "event_report://h/b"},
    ]

    def add2(key: int) -> dict[str, Any]:
        body = {"block_key": str(key), "medium": "hbm", "specs": two}
        return {"event_type": "EVENT_BLOCK_ADD", "block_add": body}

    assert code(await api("registerInstance", REG)) == "OK"
    spellings: list[tuple[str, Callable[[Any], Any]]] = [
        (HOST, lambda b: b),
        ("10.0.0.2:8000", P.camel),
    ]
    for host, spell in spellings:
        body = {
            "trace_id": "t",
            "instance_id": IID,
            "host_ip_port": host,
            "storage_type": "ST_EVENT_REPORT_L1P5",
            "events": [add2(1), add2(2), add2(3), delete(1), delete(2), delete(9)],
        }
        status, resp = await api.raw("reportEvent", msgspec.json.encode(spell(body)))
        assert status == 200 and code(resp) == "OK"
        more = {**body, "events": [delete(2, spec="swa")]}
        status, resp = await api.raw("reportEvent", msgspec.json.encode(spell(more)))
        assert status == 200 and code(resp) == "OK"
    blocks = api.server.state.blocks[IID]
    for host in (HOST, "10.0.0.2:8000"):
        left = {
            k: sorted(n for n, _ in specs)
            for k in (1, 2, 3)
            for loc, specs in (blocks.get(k) or {}).items()
            if loc[2] == host
        }
        assert left == {1: ["swa"], 3: ["full", "swa"]}, host


# ---- contract §12: what every reply says (issue #12, one test per rule) ----------------------
def _version(resp: dict[str, Any]) -> str:
    v: str = resp["committed_snapshot_version"]
    return v


async def test_report_version_in_every_reply_once_the_generation_exists(api: Api) -> None:
    """Rule 1: from the first valid ADD or DELETE on, every reply for the reporter carries its
    generation's version, whether or not a snapshot committed; `""` only before that."""
    assert _version(await api.report(HEARTBEAT)) == ""  # no generation yet
    assert _version(await api.report(add("bad"))) == ""  # an invalid-only delta creates none
    first = await api.report(add(1))
    v = _version(first)
    assert HEX32.fullmatch(v) and first["snapshot_required"] is True
    replies = {
        "delta": await api.report(add(2), delete(1)),
        "heartbeat": await api.report(HEARTBEAT),
        "register": await api.report(REGISTER),
        "item failure": await api.report(add(3), add("x")),
        "failed snapshot": await api.report(snap(4, "0004")),
    }
    assert {k: (_version(r), r["snapshot_required"]) for k, r in replies.items()} == {
        k: (v, False) for k in replies
    }
    assert code(replies["item failure"]) == code(replies["failed snapshot"]) == "INVALID_ARGUMENT"
    api.server.report.commit_delay_s = 0.05  # hold one snapshot open: the other is rejected
    a, b = await asyncio.gather(api.report(snap(5)), api.report(snap(6)))
    busy = b if code(a) == "OK" else a
    assert code(busy) == "SNAPSHOT_IN_PROGRESS" and _version(busy) == v
    committed = _version(a if busy is b else b)
    assert HEX32.fullmatch(committed) and committed != v
    limited = await api.report(snap(7))
    assert code(limited) == "SNAPSHOT_RATE_LIMITED" and _version(limited) == committed
    # A generation created by a DELETE alone (nothing to delete) is answered the same way.
    d = await api.report(delete(8), host="10.0.0.9:1")
    assert HEX32.fullmatch(_version(d)) and d["snapshot_required"] is True
    assert _version(await api.report(HEARTBEAT, host="10.0.0.9:1")) == _version(d)


async def test_host_down_reply_ends_the_generation(api: Api) -> None:
    """Rule 2: HOST_DOWN's own reply has snapshot_required=true and version ""."""
    assert HEX32.fullmatch(_version(await api.report(snap(1))))
    down = await api.report(HOST_DOWN)
    assert code(down) == "OK" and down["snapshot_required"] is True and _version(down) == ""
    assert await api.visible() == []


async def test_host_down_on_a_tombstone_is_ok_other_events_not_registered(
    api: Api, clock: FakeClock
) -> None:
    """Rule 3: HOST_DOWN is idempotent on a tombstone (after HOST_DOWN or past cleanup grace);
    every other event there answers NODE_NOT_REGISTERED until a NODE_REGISTER."""
    await api.report(add(1))
    await api.report(HOST_DOWN)
    again = await api.report(HOST_DOWN)
    assert code(again) == "OK" and again["snapshot_required"] is True and _version(again) == ""
    for ev in (add(2), delete(1), HEARTBEAT, snap(3)):
        assert code(await api.report(ev)) == "NODE_NOT_REGISTERED", ev["event_type"]
    await api.report(add(4), HEARTBEAT, host="10.0.0.2:8000")
    clock.t += 1.5  # past cleanup_grace_ms: tombstoned by the liveness rules
    assert code(await api.report(HOST_DOWN, host="10.0.0.2:8000")) == "OK"
    assert code(await api.report(HEARTBEAT, host="10.0.0.2:8000")) == "NODE_NOT_REGISTERED"
    assert code(await api.report(REGISTER, add(5))) == "OK"
    assert await api.visible() == [5]


@pytest.mark.parametrize("spell", [lambda b: b, P.camel], ids=["typed", "dict"])
async def test_snapshot_validated_before_the_rate_limit(
    api: Api, spell: Callable[[Any], Any]
) -> None:
    """Rule 4: inside the cool-down an invalid snapshot answers INVALID_ARGUMENT with the
    current version (not SNAPSHOT_RATE_LIMITED); a valid one is rate limited. Both paths."""

    async def send(*events: dict[str, Any]) -> dict[str, Any]:
        body = {"instance_id": IID, "host_ip_port": HOST, "events": list(events)}
        raw = msgspec.json.encode(spell({**body, "storage_type": "ST_EVENT_REPORT_L1P5"}))
        status, resp = await api.raw("reportEvent", raw)
        assert status == 200
        out: dict[str, Any] = resp
        return out

    v = _version(await send(snap(1)))
    bad_key = snap(2)
    bad_key["block_snapshot"]["blocks"][0]["block_key"] = "+2"
    for bad in (snap(2, "02"), snap(2, medium="a#b"), bad_key):
        resp = await send(bad)
        assert code(resp) == "INVALID_ARGUMENT" and resp["item_results"] == ["INVALID_ARGUMENT"]
        assert _version(resp) == v and resp["retry_after_ms"] == "0"
    limited = await send(snap(2))
    assert code(limited) == "SNAPSHOT_RATE_LIMITED" and int(limited["retry_after_ms"]) > 0
    assert _version(limited) == v and await api.visible() == [1]


async def test_get_cache_location_rows_name_their_storage_type(api: Api) -> None:
    """Rule 5: each BATCH_GET row's `type` is the storage type of its locations."""
    await api.report(add(1), add(3))
    await api.report(add(2), add(3, medium="dram"), storage_type="ST_EVENT_REPORT_L2")
    await api.report(add(3, medium="dram"), host="10.0.0.2:8000")
    resp = await api(
        "getCacheLocation",
        {"instance_id": IID, "query_type": "QT_BATCH_GET", "block_keys": [1, "2", 3, 4]},
    )
    rows = resp["locations"]
    assert [r["type"] for r in rows[:3]] == [
        "ST_EVENT_REPORT_L1P5",
        "ST_EVENT_REPORT_L2",
        "ST_EVENT_REPORT_L1P5",  # both types hold key 3: one row, of the first type
    ]
    # key 3 of L1P5: the hbm copy on HOST and the dram copy on 10.0.0.2 (its L2 copy is left out)
    assert [r["spec_size"] for r in rows] == [1, 1, 2, 0]
    assert rows[3]["location_specs"] == []


async def test_get_cache_locations_by_backend_selectors_and_key_locations(api: Api) -> None:
    """Rule 6: the filter comes from `backend_selectors[].backend_type` (name or number); the
    answer is `key_locations[].locations[]`, one entry per requested key."""
    two = [{"name": "full", "uri": "event_report://h/a"}, {"name": "swa", "uri": "x://b"}]
    ev = {
        "event_type": "EVENT_BLOCK_ADD",
        "block_add": {"block_key": "1", "medium": "hbm", "specs": two},
    }
    await api.report(ev)
    await api.report(add(1), storage_type="ST_EVENT_REPORT_L2")

    async def by_backend(*selectors: Any, **extra: Any) -> list[list[tuple[str, int]]]:
        resp = await api(
            "getCacheLocationsByBackend",
            {
                "instance_id": IID,
                "query_type": "QT_BATCH_GET",
                "block_keys": [1, 2],
                "backend_selectors": [{"backend_type": b, "strategy": 0} for b in selectors],
                **extra,
            },
        )
        assert code(resp) == "OK"
        return [
            [(loc["type"], loc["spec_size"]) for loc in k["locations"]]
            for k in resp["key_locations"]
        ]

    l1, l2 = "ST_EVENT_REPORT_L1P5", "ST_EVENT_REPORT_L2"
    assert await by_backend("ST_EVENT_REPORT_L2") == [[(l2, 1)], []]
    assert await by_backend(7) == [[(l1, 2)], []]
    assert await by_backend("8", l1) == await by_backend() == [[(l1, 2), (l2, 1)], []]
    assert await by_backend(location_spec_names=["swa"]) == [[(l1, 1)], []]
    assert await by_backend("ST_NFS") == [[], []]
    bad = await api(
        "getCacheLocationsByBackend",
        {"instance_id": IID, "block_keys": [1], "backend_selectors": [{"backend_type": "NO"}]},
    )
    assert code(bad) == "INVALID_ARGUMENT"


async def test_write_session_honours_min_replica_count(api: Api, clock: FakeClock) -> None:
    """Rule 7: startWriteCache hands out a write location (and a session id) for each key whose
    visible replicas plus finished writes are fewer than min_replica_count; once
    finishWriteCache reports success the next call for those keys answers no locations."""

    async def start(keys: list[int], n: int) -> dict[str, Any]:
        resp = await api(
            "startWriteCache",
            {
                "instance_id": IID,
                "block_keys": keys,
                "write_timeout_seconds": 10,
                "min_replica_count": n,
            },
        )
        assert code(resp) == "OK" and HEX32.fullmatch(resp["write_session_id"])
        return resp

    async def finish(session: str, mask: dict[str, Any]) -> str:
        body = {"instance_id": IID, "write_session_id": session, "success_blocks": mask}
        return code(await api("finishWriteCache", body))

    await api.report(add(1))  # key 1 has one visible replica, key 2 none
    assert (await start([1, 2], 1))["block_mask"]["bool_masks"]["values"] == [True, False]
    s = await start([1, 2], 2)
    assert len(s["locations"]) == 2 and s["locations"][0]["location_specs"][0]["name"] == "full"
    assert await finish(s["write_session_id"], {"bool_masks": {"values": [True, True]}}) == "OK"
    assert await finish(s["write_session_id"], {"offset": 2}) == "INVALID_ARGUMENT"  # spent
    s = await start([1, 2], 2)  # key 1: 1 visible + 1 written; key 2: 1 written
    assert s["block_mask"]["bool_masks"]["values"] == [True, False] and len(s["locations"]) == 1
    assert await finish(s["write_session_id"], {"offset": 1}) == "OK"
    assert (await start([1, 2], 2))["locations"] == []
    late = await start([1, 2], 3)
    clock.t += 11  # past write_timeout_seconds: the session expired, nothing was written
    assert await finish(late["write_session_id"], {"offset": 2}) == "INVALID_ARGUMENT"
    assert len((await start([1, 2], 3))["locations"]) == 2
