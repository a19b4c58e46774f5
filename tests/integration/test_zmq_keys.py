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


def sidecar(
    h: Harness,
    pub: PublisherProcess,
    tmp: Path,
    host: str,
    *,
    instance: str = "",
    subscribers: int = 1,
    **s: str,
) -> SidecarProc:
    r = pub.ready
    settings = {
        **h.settings,
        **ZMQ_SETTINGS,
        "source.zmq.endpoint": r["pub"],
        "source.zmq.replay_endpoint": r["replay"],
        "source.state_dir": str(tmp / (host.replace(":", "_") + instance)),
        "source.zmq.block_size": "8",
        "source.zmq.key_mode": "rolling",
        "source.zmq.kvcm_block_size": "4",
        **s,
    }
    env = {**h.sidecar_env(), "KV_CACHE_EVENT_HOST_IP_PORT": host}
    if instance:
        env["KV_CACHE_EVENT_INSTANCE_ID"] = instance
    side = SidecarProc(env, settings)
    line = side.wait_line("http listening")
    if host == h.host and not instance:  # h.status() / h.metrics() read this one
        h.metrics_port = int(json.loads(line)["msg"].rsplit(":", 1)[1])
    pub.call("wait_subscribers", n=subscribers)
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


async def test_zmq_keys_lora_adapter_reported_under_its_own_instance(
    h: Harness, tmp_path: Path
) -> None:
    """One engine serving the base model and a LoRA adapter; the base model's sidecar and the
    adapter's (source.zmq.lora_adapter, its own instance id) subscribe to the same stream. Each
    instance holds exactly its own prefixes under token keys, and a router asking the adapter's
    instance with token_ids finds the adapter's cached prefix, not the base model's."""
    pub = PublisherProcess(engine_hash="vllm_default", block_size=8)
    sql = f"{h.instance_id}-sql"
    base = sidecar(h, pub, tmp_path, h.host)
    adapter = sidecar(
        h,
        pub,
        tmp_path,
        h.host,
        instance=sql,
        subscribers=2,
        **{"source.zmq.lora_adapter": "sql", "source.zmq.engine": "vllm"},
    )
    try:
        other = [(i * 13 + 5) % 5000 for i in range(16)]
        pub.call("store", token_ids=PROMPT[:16], step=True)  # the base model: 2 blocks
        first = pub.call("store", token_ids=PROMPT[:16], lora_name="sql", lora_id=1, step=True)
        second = pub.call(
            "store",
            token_ids=PROMPT[16:],
            parent=first["hashes"][-1],
            lora_name="sql",
            lora_id=1,
            step=True,
        )
        pub.call("store", token_ids=other, lora_name="chat", lora_id=2, step=True)

        async def held(instance: str) -> set[int]:
            for r in (await h.debug())["reporters"]:
                if r["instance_id"] == instance and r["host_ip_port"] == h.host:
                    return {int(k) for k in r["visible_keys"]}
            return set()

        want_base = set(K.rolling_keys(PROMPT[:16], 4))
        want_sql = set(K.rolling_keys(PROMPT, 4))
        assert await until(lambda v: v == want_base, h.visible) == want_base
        assert await until(lambda v: v == want_sql, lambda: held(sql)) == want_sql
        loc = await api(
            h,
            "getCacheLocation",
            {"instance_id": sql, "query_type": "QT_PREFIX_MATCH", "token_ids": PROMPT},
        )
        assert len(loc["locations"]) == 6  # the adapter's whole prompt, in its instance

        async def unkeyed() -> tuple[Any, Any]:  # the base model's sidecar's counts
            got = (await h.status())["rekey"]["blocks_unkeyed"]
            return got.get("lora"), got.get("tainted")

        # the base model's keys are visible after its first batch; the adapters' batches that
        # follow may still be on their way to its counters
        assert await until(lambda v: v == (4, 1), unkeyed) == (4, 1)
        # the adapter's blocks go when the engine evicts them; the base model's stay
        pub.call("remove", hashes=[first["hashes"][1], *second["hashes"]], step=True)
        want_sql = set(K.rolling_keys(PROMPT[:8], 4))
        assert await until(lambda v: v == want_sql, lambda: held(sql)) == want_sql
        assert await h.visible() == want_base
    finally:
        adapter.close()
        base.close()
        pub.close()
