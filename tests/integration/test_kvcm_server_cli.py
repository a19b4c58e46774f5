"""`kvcm-sidecar kvcm-server` as a real process: port 0, split admin port, SIGTERM."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
from typing import Any

from tests.proc import ROOT


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
            {
                "instance_group": "default",
                "instance_id": "cli",
                "block_size": 16,
                "location_spec_infos": [{"name": "full", "size": 1}],
                "model_deployment": {"model_name": "m", "dtype": "fp16"},
            },
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
