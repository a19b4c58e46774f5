"""Config: sources, precedence, and the bad-config table (exit 2 naming the field)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sidecar import config as C
from sidecar.testbed.proc import ROOT

GOOD = {
    "KV_CACHE_EVENT_MANAGER_ENDPOINT": "http://127.0.0.1:6382",
    "KV_CACHE_EVENT_INSTANCE_ID": "inst",
    "KV_CACHE_EVENT_HOST_IP_PORT": "10.0.0.1:8000",
}


def test_config_defaults_are_the_seed_values() -> None:
    cfg = C.load(env=GOOD)
    assert cfg.report.heartbeat_interval_s == 1.0
    assert cfg.manager.request_timeout_s == 1.5
    assert cfg.manager.snapshot_timeout_s == 30.0
    assert cfg.report.backoff_cap_s == 30.0
    assert cfg.report.periodic_snapshot_s == 300.0
    assert cfg.report.batch_max_keys == 4096
    assert cfg.report.flush_at_keys == 1000  # rtp-llm's batch
    assert cfg.report.flush_window_s == 0.02


def test_config_precedence_file_env_cli(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text(
        "[report]\nbatch_max_keys = 10\nheartbeat_interval_s = 2.0\n"
        '[manager]\ninstance_group = "file"\n'
    )
    env = {**GOOD, "KV_CACHE_EVENT_REPORT_BATCH_MAX_KEYS": "20"}
    cfg = C.load(env=env, toml_path=f, overrides={"report.batch_max_keys": "30"})
    assert cfg.report.batch_max_keys == 30
    assert cfg.report.heartbeat_interval_s == 2.0
    assert cfg.manager.instance_group == "file"


def test_config_host_ip_port_derived_per_dp_rank() -> None:
    env = {k: v for k, v in GOOD.items() if k != "KV_CACHE_EVENT_HOST_IP_PORT"}
    env |= {
        "KV_CACHE_EVENT_IDENTITY_HOST_IP": "10.0.0.1",
        "KV_CACHE_EVENT_IDENTITY_BASE_PORT": "8000",
        "KV_CACHE_EVENT_IDENTITY_PORT_STRIDE": "10",
    }
    ports = {C.load(env={**env, "KV_CACHE_EVENT_DP_RANK": str(r)}).host_ip_port() for r in range(4)}
    assert ports == {"10.0.0.1:8000", "10.0.0.1:8010", "10.0.0.1:8020", "10.0.0.1:8030"}
    tmpl = {
        **GOOD,
        "KV_CACHE_EVENT_HOST_IP_PORT": "10.0.0.1:80{dp_rank}1",
        "KV_CACHE_EVENT_DP_RANK": "3",
    }
    assert C.load(env=tmpl).host_ip_port() == "10.0.0.1:8031"


def test_config_publisher_none_needs_nothing_else() -> None:
    assert C.load(env={"KV_CACHE_EVENT_PUBLISHER_TYPE": "None"}).publisher_type == "none"


def test_config_redacts_endpoint_credentials() -> None:
    cfg = C.load(env={**GOOD, "KV_CACHE_EVENT_MANAGER_ENDPOINT": "http://u:pw@h:1"})
    assert C.redacted(cfg)["manager"]["endpoint"] == "http://***@h:1"


BAD = [
    ({"KV_CACHE_EVENT_MANAGER_ENDPOINT": ""}, "manager.endpoint"),
    ({"KV_CACHE_EVENT_INSTANCE_ID": ""}, "identity.instance_id"),
    ({"KV_CACHE_EVENT_HOST_IP_PORT": ""}, "identity.host_ip_port"),
    ({"KV_CACHE_EVENT_PUBLISHER_TYPE": "ZMQ"}, "publisher_type"),
    ({"KV_CACHE_EVENT_MANAGER_ENDPOINT": "ftp://h:1"}, "manager.endpoint"),
    ({"KV_CACHE_EVENT_MANAGER_ENDPOINT": "http://no-port"}, "manager.endpoint"),
    ({"KV_CACHE_EVENT_REPORT_HEARTBEAT_INTERVAL_S": "0"}, "report.heartbeat_interval_s"),
    ({"KV_CACHE_EVENT_REPORT_FLUSH_WINDOW_S": "-1"}, "report.flush_window_s"),
    ({"KV_CACHE_EVENT_MANAGER_REQUEST_TIMEOUT_S": "soon"}, "manager.request_timeout_s"),
    ({"KV_CACHE_EVENT_REPORT_BATCH_MAX_KEYS": "0"}, "report.batch_max_keys"),
    ({"KV_CACHE_EVENT_REPORT_RESPONSE_HOLD_S": "1.5"}, "report.response_hold_s"),
    ({"KV_CACHE_EVENT_METRICS_ADDR": "nowhere"}, "http.metrics_addr"),
    ({"KV_CACHE_EVENT_HOST_IP_PORT": "a#b:1"}, "identity.host_ip_port"),
    ({"KV_CACHE_EVENT_SOURCE": "kafka"}, "source.kind"),
    ({"KV_CACHE_EVENT_SOURCE": "zmq"}, "source.zmq.endpoint"),
    (
        {"KV_CACHE_EVENT_SOURCE": "zmq", "KV_CACHE_EVENT_ZMQ_ENDPOINT": "udp://h:1"},
        "source.zmq.endpoint",
    ),
    ({"KV_CACHE_EVENT_ZMQ_BIND": "maybe"}, "source.zmq.bind"),
    ({"KV_CACHE_EVENT_ZMQ_ENGINE": "trt"}, "source.zmq.engine"),
    ({"KV_CACHE_EVENT_ZMQ_BLOCK_SIZE": "0"}, "source.zmq.block_size"),
    (
        {
            "KV_CACHE_EVENT_SOURCE": "zmq",
            "KV_CACHE_EVENT_ZMQ_ENDPOINT": "tcp://*:5557",
            "KV_CACHE_EVENT_ZMQ_MEDIUM_MAP": "GPU=hbm,CPU",
        },
        "source.zmq.medium_map",
    ),
    (
        {
            "KV_CACHE_EVENT_SOURCE": "zmq",
            "KV_CACHE_EVENT_ZMQ_ENDPOINT": "tcp://*:5557",
            "KV_CACHE_EVENT_ZMQ_HEALTH_URL": "localhost:8000",
        },
        "source.zmq.health_url",
    ),
]


@pytest.mark.parametrize(("env", "field"), BAD)
def test_config_bad_value_names_field_and_source(env: dict[str, str], field: str) -> None:
    with pytest.raises(C.ConfigError, match=field.replace(".", r"\.")) as info:
        C.load(env={**GOOD, **env})
    assert "env KV_CACHE_EVENT_" in str(info.value) or "defaults" in str(info.value)


@pytest.mark.parametrize(("env", "field"), BAD[:6])
def test_cli_bad_config_exits_2_before_touching_shm(env: dict[str, str], field: str) -> None:
    before = set(Path("/dev/shm").iterdir())
    full = {
        "PATH": "/usr/bin:/bin",
        **GOOD,
        **env,
        "KV_CACHE_EVENT_RING_NAME": "/kvcm-never-created",
    }
    out = subprocess.run(
        [sys.executable, "-m", "sidecar.cli", "run"],
        env=full,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert field in out.stderr and out.stderr.count("\n") == 1
    # Only the configured ring's names count: other processes on the machine may come and go.
    created = set(Path("/dev/shm").iterdir()) - before
    assert not [p for p in created if "kvcm-never-created" in p.name]


def test_cli_check_config_prints_effective_config() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sidecar.cli", "check-config", "--set", "report.batch_max_keys=7"],
        env={"PATH": "/usr/bin:/bin", **GOOD},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and '"batch_max_keys": 7' in out.stdout


def test_config_unknown_set_field_is_error() -> None:
    with pytest.raises(C.ConfigError, match=r"report\.nope"):
        C.load(env=GOOD, overrides={"report.nope": "1"})


def test_config_zmq_public_env_names_are_exact() -> None:
    env = {
        **GOOD,
        "KV_CACHE_EVENT_SOURCE": "zmq",
        "KV_CACHE_EVENT_ZMQ_ENDPOINT": "tcp://*:5557",
        "KV_CACHE_EVENT_ZMQ_REPLAY_ENDPOINT": "tcp://*:5558",
        "KV_CACHE_EVENT_ZMQ_BIND": "",  # unset: infer
        "KV_CACHE_EVENT_ZMQ_TOPIC": "kv@",
        "KV_CACHE_EVENT_ZMQ_ENGINE": "SGLang",
        "KV_CACHE_EVENT_ZMQ_BLOCK_SIZE": "32",
        "KV_CACHE_EVENT_ZMQ_MODEL_NAME": "qwen",
        "KV_CACHE_EVENT_ZMQ_HEALTH_URL": "http://127.0.0.1:8000/health",
        "KV_CACHE_EVENT_STATE_DIR": "/tmp/kvcm-state",
    }
    z = C.load(env=env).source
    assert (z.kind, z.state_dir) == ("zmq", "/tmp/kvcm-state")
    assert (z.zmq.endpoint, z.zmq.replay_endpoint, z.zmq.bind) == (
        "tcp://*:5557",
        "tcp://*:5558",
        None,
    )
    assert (z.zmq.topic, z.zmq.engine, z.zmq.block_size, z.zmq.model_name) == (
        "kv@",
        "sglang",
        32,
        "qwen",
    )
    assert z.zmq.health_url == "http://127.0.0.1:8000/health"
    over = C.load(env=env, overrides={"source.zmq.bind": "true"}).source.zmq
    assert over.bind is True


@pytest.mark.parametrize(
    ("endpoint", "bind"),
    [("tcp://127.0.0.1:5557", ""), ("tcp://*:5557", "true"), ("inproc://kv", "false")],
)
def test_config_zmtp_transport_needs_a_tcp_or_ipc_endpoint_it_connects_to(
    endpoint: str, bind: str
) -> None:
    env = {**GOOD, "KV_CACHE_EVENT_SOURCE": "zmq", "KV_CACHE_EVENT_ZMQ_ENDPOINT": endpoint}
    env["KV_CACHE_EVENT_ZMQ_BIND"] = bind
    with pytest.raises(C.ConfigError, match=r"source\.zmq\.transport zmtp"):
        C.load(env=env, overrides={"source.zmq.transport": "zmtp"})
    ok = {**env, "KV_CACHE_EVENT_ZMQ_ENDPOINT": "ipc:///tmp/kv.sock", "KV_CACHE_EVENT_ZMQ_BIND": ""}
    assert C.load(env=ok, overrides={"source.zmq.transport": "zmtp"}).source.zmq.transport == "zmtp"
