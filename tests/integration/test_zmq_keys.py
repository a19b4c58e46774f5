"""Keys a router can ask for, end to end: vLLM-format engines (the zmq publisher process, blocks
hashed from their tokens) -> real `kvcm-sidecar run` in key mode rolling -> the KVCM-compatible
server, queried as a router would (token_ids, rolling keys) (issue #22 §1, §6)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from sidecar import keys as K
from sidecar.testbed.zmq_publisher import PublisherProcess
from tests.integration.harness import Harness, SidecarProc
from tests.integration.test_zmq_source import ZMQ_SETTINGS

PROMPT = [(i * 37 + 11) % 5000 for i in range(24)]  # 3 engine blocks of 8, 6 KVCM blocks of 4


async def api(h: Harness, route: str, body: dict[str, Any]) -> dict[str, Any]:
    assert h.session is not None
    async with h.session.post(f"http://127.0.0.1:{h.port}/api/{route}", json=body) as r:
        data: dict[str, Any] = await r.json()
        return data


def sidecar(h: Harness, pub: PublisherProcess, tmp: Path, host: str, **s: str) -> SidecarProc:
    r = pub.ready
    settings = {
        **h.settings,
        **ZMQ_SETTINGS,
        "source.zmq.endpoint": r["pub"],
        "source.zmq.replay_endpoint": r["replay"],
        "source.state_dir": str(tmp / host.replace(":", "_")),
        "source.zmq.block_size": "8",
        "source.zmq.key_mode": "rolling",
        "source.zmq.kvcm_block_size": "4",
        **s,
    }
    env = {**h.sidecar_env(), "KV_CACHE_EVENT_HOST_IP_PORT": host}
    side = SidecarProc(env, settings)
    line = side.wait_line("http listening")
    if host == h.host:  # h.status() / h.metrics() read this one
        h.metrics_port = int(json.loads(line)["msg"].rsplit(":", 1)[1])
    pub.call("wait_subscribers", n=1)
    return side


def serve_prompt(pub: PublisherProcess) -> list[Any]:
    """The engine caches PROMPT in two steps (the second continues from its parent); returns
    the engine's hashes of its three blocks."""
    first = pub.call("store", token_ids=PROMPT[:16], step=True)
    second = pub.call("store", token_ids=PROMPT[16:], parent=first["hashes"][-1], step=True)
    return [*first["hashes"], *second["hashes"]]


async def host_state(h: Harness, keys: list[int]) -> dict[str, int]:
    resp = await api(
        h,
        "getHostCacheState",
        {"instance_id": h.instance_id, "query_type": "QT_PREFIX_MATCH", "block_cache_keys": keys},
    )
    return {x["host_ip_port"]: int(x["local"]) for x in resp.get("hosts", [])}


async def until(pred: Any, probe: Any, within_s: float = 20.0) -> Any:
    deadline = time.monotonic() + within_s
    while True:
        got = await probe()
        if pred(got):
            return got
        assert time.monotonic() < deadline, f"never matched: {got}"
        await asyncio.sleep(0.02)  # polling another process's state, bounded by deadline


async def test_zmq_keys_rolling_answers_token_id_and_rolling_key_queries(
    h: Harness, tmp_path: Path
) -> None:
    pub = PublisherProcess(engine_hash="random_seed", block_size=8)
    side = sidecar(h, pub, tmp_path, h.host)
    try:
        hashes = serve_prompt(pub)
        keys = K.rolling_keys(PROMPT, 4)
        got = await until(lambda v: v == set(keys), h.visible)
        assert got == set(keys)  # the engine's own hashes are nowhere
        loc = await api(
            h,
            "getCacheLocation",
            {
                "instance_id": h.instance_id,
                "query_type": "QT_PREFIX_MATCH",
                "token_ids": [*PROMPT, 1, 2],  # KVCM hashes the full blocks itself
            },
        )
        assert len(loc["locations"]) == 6
        assert await host_state(h, keys) == {h.host: 6}
        assert await host_state(h, [*keys[:2], 12345, *keys[3:]]) == {h.host: 2}  # a prefix
        st = await h.status()
        assert st["key_mode"] == "rolling" and st["rekey"]["kvcm_block_size"] == 4
        assert st["key_check"]["vllm_sha256_cbor"] == 0  # a random seed: no router matches it
        # removing the middle engine block removes its two KVCM keys
        pub.call("remove", hashes=[hashes[1]], step=True)
        await until(lambda v: v == set(keys) - set(keys[2:4]), h.visible)
    finally:
        side.close()
        pub.close()


async def test_zmq_keys_two_engines_with_different_seeds_share_keys_both_hosts_listed(
    h: Harness, tmp_path: Path
) -> None:
    hosts = ["127.0.0.1:31001", "127.0.0.1:31002"]
    pubs = [PublisherProcess(engine_hash="random_seed", block_size=8) for _ in hosts]
    sides = [sidecar(h, p, tmp_path, host) for p, host in zip(pubs, hosts, strict=True)]
    try:
        engine_keys = []
        for p in pubs:
            serve_prompt(p)
            engine_keys.append({k for k, _m in p.truth(group=0)})
        assert not engine_keys[0] & engine_keys[1]  # two key spaces in engine mode
        keys = K.rolling_keys(PROMPT, 4)
        want = {hosts[0]: 6, hosts[1]: 6}  # both hosts, each with the whole prefix
        got = await until(lambda s: s == want, lambda: host_state(h, keys))
        assert got == want
    finally:
        for s in sides:
            s.close()
        for p in pubs:
            p.close()


async def test_zmq_keys_rolling_table_survives_a_sidecar_restart(
    h: Harness, tmp_path: Path
) -> None:
    """SIGKILL the sidecar after its checkpoint; the restarted one loads the key table with it,
    so a block stored later under a parent from before the restart still gets its key."""
    # The engine's buffer holds the last batch only: the checkpoint's proof, not a replay from 0
    pub = PublisherProcess(engine_hash="random_seed", block_size=8, buffer_steps=1)
    side = sidecar(h, pub, tmp_path, h.host)
    try:
        hashes = serve_prompt(pub)
        keys = K.rolling_keys(PROMPT, 4)
        await until(lambda v: v == set(keys), h.visible)
        await until(lambda s: 0 <= s["checkpoint_age_s"] < 1.0, h.status)
        side.close()  # SIGKILL
        side = sidecar(h, pub, tmp_path, h.host)
        more = [7, 7, 7, 7, 8, 8, 8, 8]
        pub.call("store", token_ids=more, parent=hashes[-1], step=True)
        want = set(K.rolling_keys(PROMPT + more, 4))
        await until(lambda v: v == want, h.visible)
        st = await h.status()
        assert st["rekey"]["blocks_unkeyed"].get("unknown_parent", 0) == 0
    finally:
        side.close()
        pub.close()
