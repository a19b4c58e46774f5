"""deploy/: systemd unit verifies, k8s manifest validates against the schema, alert rules pass
promtool (or the documented fallback), dashboard and alert expressions use real metrics."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from sidecar.metrics.registry import METRICS

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
METRIC_RE = re.compile(r"\bkvcm_sidecar_[a-z_]+")


def _known(name: str) -> bool:
    for base, (kind, _h) in METRICS.items():
        family = f"{base}_total" if kind == "counter" else base
        suffixes = ("", "_bucket", "_sum", "_count") if kind == "histogram" else ("",)
        if any(name == family + s for s in suffixes):
            return True
    return False


def test_systemd_unit_verifies(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed on this machine")
    exe = Path(sys.executable).with_name("kvcm-sidecar")
    if not exe.exists():
        exe = Path(sys.executable)
    text = (DEPLOY / "systemd" / "kvcm-sidecar@.service").read_text()
    env = tmp_path / "env"
    env.write_text((DEPLOY / "systemd" / "env.example").read_text())
    text = text.replace("/usr/local/bin/kvcm-sidecar", str(exe))
    text = text.replace("/etc/kvcm-sidecar/env", str(env))
    text = text.replace("User=kvcm-sidecar\nGroup=kvcm-sidecar\n", "User=root\nGroup=root\n")
    unit = tmp_path / "kvcm-sidecar@.service"
    unit.write_text(text)
    inst = tmp_path / "kvcm-sidecar@0.service"
    inst.symlink_to(unit)
    out = subprocess.run(
        [analyze, "verify", "--man=no", str(inst)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    problems = [
        line
        for line in out.stderr.splitlines()
        if "kvcm-sidecar" in line and "Failed to" not in line.split(":", 1)[0]
    ]
    assert out.returncode == 0, out.stderr
    assert not problems, problems


def test_systemd_unit_stop_timeout_above_drain_grace() -> None:
    from sidecar.config import ShutdownConfig

    text = (DEPLOY / "systemd" / "kvcm-sidecar@.service").read_text()
    stop = int(re.search(r"TimeoutStopSec=(\d+)", text).group(1))  # type: ignore[union-attr]
    assert stop > ShutdownConfig().grace_s
    assert "Restart=on-failure" in text and "NoNewPrivileges=yes" in text


def _manifests(name: str = "engine-with-kvcm-sidecar.yaml") -> list[dict[str, Any]]:
    docs = yaml.safe_load_all((DEPLOY / "k8s" / name).read_text())
    return [d for d in docs if d]


@pytest.mark.parametrize("version", ["1.30", "1.33"])
@pytest.mark.parametrize("name", ["engine-with-kvcm-sidecar.yaml", "vllm-with-kvcm-sidecar.yaml"])
def test_k8s_manifest_validates_against_schema(version: str, name: str) -> None:
    for doc in _manifests(name):
        kubernetes_validate.validate(doc, version, strict=True)


def test_k8s_vllm_manifest_config_is_valid_and_matches_the_engine() -> None:
    """The sidecar's env loads (exit-2 rules) and names the ports vLLM's config opens."""
    from sidecar import config as C

    (dep,) = _manifests("vllm-with-kvcm-sidecar.yaml")
    spec = dep["spec"]["template"]["spec"]
    (side,) = spec["initContainers"]
    assert side["restartPolicy"] == "Always"
    env = {e["name"]: e.get("value", "") for e in side["env"]}
    env["KV_CACHE_EVENT_HOST_IP_PORT"] = "10.0.0.5:8000"  # what $(POD_IP) expands to
    cfg = C.load(env=env)
    assert cfg.source.kind == "zmq" and cfg.source.state_dir.startswith("/dev/shm/")
    (vllm,) = spec["containers"]
    flag = next(a for a in vllm["args"] if a.startswith("--kv-events-config="))
    kv = json.loads(flag.split("=", 1)[1])
    assert kv["enable_kv_cache_events"] and kv["publisher"] == "zmq"
    z = cfg.source.zmq
    assert (kv["endpoint"], kv["replay_endpoint"], kv["topic"]) == (
        z.endpoint,
        z.replay_endpoint,
        z.topic,
    )
    assert f"--block-size={z.block_size}" in vllm["args"]
    assert z.health_url.endswith(":8000/health")
    for c in [side, vllm]:
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]


def test_k8s_manifest_is_native_sidecar_sharing_dev_shm() -> None:
    from sidecar.config import ShutdownConfig

    (dep,) = _manifests()
    spec = dep["spec"]["template"]["spec"]
    (side,) = spec["initContainers"]
    assert side["restartPolicy"] == "Always"
    assert {v["name"]: v for v in spec["volumes"]}["dshm"]["emptyDir"]["medium"] == "Memory"
    for c in [side, *spec["containers"]]:
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert side["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert side["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert spec["terminationGracePeriodSeconds"] > ShutdownConfig().grace_s
    assert side["resources"]["requests"]
    ann = dep["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"


def test_prometheus_rules_pass_promtool() -> None:
    promtool = shutil.which("promtool")
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    unknown = {m for e in exprs for m in METRIC_RE.findall(e) if not _known(m)}
    assert not unknown, unknown
    if promtool is None:
        pytest.skip("promtool unavailable: rules parsed and metric names checked (fallback)")
    for args in (["check", "rules", "alerts.yml"], ["test", "rules", "alerts_test.yml"]):
        out = subprocess.run(
            [promtool, *args], cwd=DEPLOY / "prometheus", capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stdout + out.stderr


def test_grafana_dashboard_queries_use_known_metrics() -> None:
    dash = json.loads((DEPLOY / "grafana" / "kvcm-sidecar.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    unknown = {m for e in exprs for m in METRIC_RE.findall(e) if not _known(m)}
    assert not unknown, unknown


def test_grafana_dashboard_shows_every_zmq_source_metric() -> None:
    from sidecar.metrics.registry import ZMQ_ONLY

    dash = json.loads((DEPLOY / "grafana" / "kvcm-sidecar.json").read_text())
    used = {m for p in dash["panels"] for t in p["targets"] for m in METRIC_RE.findall(t["expr"])}
    for name in ZMQ_ONLY:
        family = f"{name}_total" if METRICS[name][0] == "counter" else name
        assert family in used, family
