"""`kvcm-sidecar status`: a human (or --json) summary of one sidecar; exit 0 healthy, 1 not.

Imports: stdlib + sidecar.config + sidecar.shm_ring. Reads the daemon's /status; when the daemon
does not answer, reads the ring header directly so an operator still sees the engine side.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

from sidecar.config import ConfigError, load, parse_addr
from sidecar.shm_ring import layout as L
from sidecar.shm_ring.segment import Segment

HEALTHY = {"READY"}


def fetch(url: str, timeout_s: float = 2.0) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 - operator URL
        data: dict[str, Any] = json.loads(resp.read())
        return data


def ring_summary(name: str) -> dict[str, Any]:
    seg = Segment(name, create=False)
    try:
        h = seg.hdr
        age = (time.monotonic_ns() - int(h[L.W_LIVENESS_NS])) / 1e9
        return {
            "state": "DAEMON_DOWN",
            "reason": "the sidecar's /status did not answer; showing the ring header",
            "ring": name,
            "ring_capacity": seg.capacity,
            "ring_lag": int(h[L.W_TAIL]) - int(h[L.W_HEAD]),
            "dropped": int(h[L.W_DROPPED]),
            "last_seq": int(h[L.W_LAST_SEQ]),
            "engine_incarnation": f"{int(h[L.W_BOOT_ID]):016x}",
            "engine_pid": int(h[L.W_PID]),
            "engine_liveness_age_s": round(age, 3),
        }
    finally:
        seg.close()


def render(doc: Mapping[str, Any]) -> str:
    lines = [f"kvcm-sidecar: {doc.get('state')} ({doc.get('reason', '')})"]
    order = [
        "instance_id",
        "dp_rank",
        "host_ip_port",
        "registered",
        "manager_leader",
        "engine_sync",
        "engine_incarnation",
        "epoch",
        "published",
        "acked",
        "dirty",
        "in_flight",
        "ring_lag",
        "dropped",
        "last_seq",
        "resyncs",
        "ring",
        "ring_capacity",
        "engine_pid",
        "engine_liveness_age_s",
    ]
    lines.extend(f"  {key:<22} {doc[key]}" for key in order if key in doc)
    if "key_mode" in doc:  # the ZMQ source: keys a router can ask for
        kc = doc.get("key_check", {})
        checks = ", ".join(
            f"{s}={'-' if kc.get(s) is None else kc[s]}"
            for s in ("vllm_sha256_cbor", "sglang_sha256")
        )
        lines.append(f"  {'key_mode':<22} {doc['key_mode']}")
        lines.append(f"  {'key_check':<22} {checks}")
        if "rekey" in doc:
            r = doc["rekey"]
            lines.append(f"  {'key_table_entries':<22} {r.get('key_table_entries')}")
            lines.append(f"  {'key_table_evictions':<22} {r.get('key_table_evictions')}")
            lines.append(f"  {'blocks_unkeyed':<22} {r.get('blocks_unkeyed')}")
    for op, t in sorted(doc.get("last_success", {}).items()):
        lines.append(f"  last ok {op:<14} {time.strftime('%H:%M:%S', time.localtime(t))}")
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    overrides = {k: v for k, v in vars(args).items() if "." in k and v is not None}
    for item in args.set:
        path, _, value = item.partition("=")
        overrides[path] = value
    try:
        # Only identity and address are needed: publisher_type=none skips kvcm-only checks.
        cfg = load(
            env={**env, "KV_CACHE_EVENT_PUBLISHER_TYPE": "none"},
            toml_path=args.config,
            overrides=overrides,
        )
    except ConfigError as exc:
        sys.stderr.write(f"kvcm-sidecar: config error: {exc}\n")
        return 2
    host, port = parse_addr(cfg.http.metrics_addr)
    url = args.url or f"http://{host}:{port}/status"
    try:
        doc = fetch(url)
    except (urllib.error.URLError, OSError, ValueError):
        if cfg.source.kind == "zmq":
            doc = {
                "state": "DAEMON_DOWN",
                "reason": f"no /status at {url} (source zmq: no ring to read)",
                "source": "zmq",
            }
            sys.stdout.write(
                json.dumps(doc, indent=2, sort_keys=True) + "\n" if args.json else render(doc)
            )
            return 1
        name = cfg.ring.name or L.segment_name(cfg.identity.instance_id, cfg.identity.dp_rank)
        try:
            doc = ring_summary(name)
        except (FileNotFoundError, L.LayoutError) as exc:
            doc = {"state": "UNKNOWN", "reason": f"no /status at {url} and no ring: {exc}"}
    sys.stdout.write(json.dumps(doc, indent=2, sort_keys=True) + "\n" if args.json else render(doc))
    return 0 if doc.get("state") in HEALTHY else 1
