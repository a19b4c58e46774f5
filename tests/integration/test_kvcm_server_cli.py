"""`kvcm-sidecar kvcm-server` as a real process: port 0, split admin port, SIGTERM."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
from typing import Any

from sidecar.testbed.proc import ROOT

REG = {
    "instance_group": "default",
    "instance_id": "cli",
    "block_size": 16,
    "location_spec_infos": [{"name": "full", "size": 1}],
    "model_deployment": {"model_name": "m", "dtype": "fp16"},
}


def _post(base: str, route: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        f"{base}/api/{route}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        out: dict[str, Any] = json.loads(resp.read())
        return out


def _start(*args: str) -> tuple[subprocess.Popen[str], dict[str, str]]:
    p = subprocess.Popen(
        [sys.executable, "-m", "sidecar.cli", "kvcm-server", "--meta-port", "0", *args],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert p.stdout is not None
    bases: dict[str, str] = {}
    want = 2 if "--admin-port" in args else 1
    while len(bases) < want:
        line = p.stdout.readline()
        assert line, "server exited before listening"
        if "listening on" in line:
            bases[line.split()[1]] = line.rsplit(" ", 1)[1].strip()
    return p, bases


def test_kvcm_server_cli_bootstrap_serves_and_exits_0_on_sigterm() -> None:
    p, bases = _start("--bootstrap")
    try:
        base = bases["meta"]
        reg = _post(
            base,
            "registerInstance",
            REG,
        )
        assert reg["header"]["status"]["code"] == "OK"
        rep = _post(
            base,
            "reportEvent",
            {
                "instance_id": "cli",
                "host_ip_port": "h:1",
                "storage_type": "ST_EVENT_REPORT_L1P5",
                "events": [{"event_type": "EVENT_HEARTBEAT", "heartbeat": {}}],
            },
        )
        assert rep["header"]["status"]["code"] == "OK" and rep["retry_after_ms"] == "0"
        groups = _post(base, "getInstanceGroup", {"name": "default"})
        assert groups["instance_group"]["event_report_storage_candidates"]
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=10) == 0
        assert p.stdout is not None
        p.stdout.close()


def test_kvcm_server_cli_split_admin_port() -> None:
    p, bases = _start("--admin-port", "0")
    try:
        ok = _post(
            bases["admin"],
            "addStorage",
            {"storage": {"global_unique_name": "s1", "storage_type": "ST_EVENT_REPORT_L1P5"}},
        )
        assert ok["header"]["status"]["code"] == "OK"
        try:
            _post(bases["meta"], "addStorage", {})
            raise AssertionError("admin route served on the meta port")
        except urllib.error.HTTPError as exc:
            assert exc.code in (404, 405)
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=10) == 0
        assert p.stdout is not None
        p.stdout.close()


def _report(base: str, *events: dict[str, Any]) -> dict[str, Any]:
    body = {
        "instance_id": "cli",
        "host_ip_port": "h:1",
        "storage_type": "ST_EVENT_REPORT_L1P5",
        "events": list(events),
    }
    return _post(base, "reportEvent", body)


def _add(key: int) -> dict[str, Any]:
    spec = {"name": "full", "uri": f"event_report://h:1/hbm/{key}"}
    body = {"block_key": str(key), "medium": "hbm", "specs": [spec]}
    return {"event_type": "EVENT_BLOCK_ADD", "block_add": body}


def _uris(base: str, key: int) -> list[str]:
    loc = _post(
        base,
        "getCacheLocation",
        {"instance_id": "cli", "query_type": "QT_BATCH_GET", "block_keys": [key]},
    )
    return [s["uri"] for s in loc["locations"][0]["location_specs"]]


def _stop(p: subprocess.Popen[str]) -> None:
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=10) == 0
    assert p.stdout is not None
    p.stdout.close()


def test_kvcm_server_cli_restart_sequence_with_state_file(tmp_path: Any) -> None:
    """Contract §12 "Restart", across two server processes sharing one state file: the old
    blocks are hidden until the reporter's first event, which answers snapshot_required=true
    and version ""; then they are visible with their old s_version; the next ADD answers a
    fresh version (and, creating the generation, snapshot_required=true: KVCM's
    report_event.md §3.4); a snapshot then commits yet another version."""
    state = str(tmp_path / "kvcm.json")
    snap = {
        "event_type": "EVENT_BLOCK_SNAPSHOT",
        "block_snapshot": {"blocks": [_add(1)["block_add"]]},
    }
    p, bases = _start("--bootstrap", "--state-file", state)
    try:
        assert _post(bases["meta"], "registerInstance", REG)["header"]["status"]["code"] == "OK"
        old = _report(bases["meta"], snap)["committed_snapshot_version"]
        assert len(old) == 32 and _uris(bases["meta"], 1)[0].endswith(f"s_version={old}")
    finally:
        _stop(p)  # saves the state file

    p, bases = _start("--bootstrap", "--state-file", state)
    try:
        base = bases["meta"]
        assert _uris(base, 1) == []  # hidden until the reporter's first event
        hb = _report(base, {"event_type": "EVENT_HEARTBEAT", "heartbeat": {}})
        assert hb["header"]["status"]["code"] == "OK"
        assert hb["snapshot_required"] is True and hb["committed_snapshot_version"] == ""
        assert _uris(base, 1) == [f"event_report://h:1/hbm/1?s_version={old}"]
        first = _report(base, _add(2))
        fresh = first["committed_snapshot_version"]
        assert len(fresh) == 32 and fresh != old and first["snapshot_required"] is True
        again = _report(base, _add(3))
        assert again["committed_snapshot_version"] == fresh
        assert again["snapshot_required"] is False
        assert _uris(base, 1)[0].endswith(old) and _uris(base, 2)[0].endswith(fresh)
        new = _report(base, snap)
        assert new["snapshot_required"] is False
        assert new["committed_snapshot_version"] not in ("", old, fresh)
        assert _uris(base, 2) == []  # strict now: omitted from the snapshot
    finally:
        _stop(p)
