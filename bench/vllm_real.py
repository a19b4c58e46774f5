"""vLLM's own KV-event publisher (`vllm/distributed/kv_events.py`), loaded from its wheel.

Imports: stdlib, msgspec, pyzmq. A benchmark dependency only (never a test one, never committed):
`pip download --no-deps vllm==0.33.0 -d ~/.cache/kvcm-bench` once; the module is read straight
from the wheel and executed with stubs for its four vLLM imports (a config dataclass, a logger,
three network helpers, a type alias), so the code that runs is vLLM's, byte for byte.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import socket
import sys
import types
import zipfile
from typing import Any

CACHE = os.path.expanduser("~/.cache/kvcm-bench")
VERSION = "0.33.0"
MODULE = "vllm/distributed/kv_events.py"


def wheel() -> str | None:
    found = sorted(glob.glob(os.path.join(CACHE, f"vllm-{VERSION}-*.whl")))
    return found[0] if found else None


@dataclasses.dataclass
class _KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = ""
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""


def _split_zmq_path(path: str) -> tuple[str, str, str]:
    scheme, rest = path.split("://", 1)
    host, _, port = rest.rpartition(":")
    return scheme, host, port


def _stub(name: str, **attrs: Any) -> None:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod


def load() -> types.ModuleType:
    """The real module (raises FileNotFoundError with the download command if it is missing)."""
    if "kvcm_bench_vllm_kv_events" in sys.modules:
        return sys.modules["kvcm_bench_vllm_kv_events"]
    path = wheel()
    if path is None:
        raise FileNotFoundError(
            f"vLLM {VERSION} wheel not in {CACHE}: "
            f"pip download --no-deps vllm=={VERSION} -d {CACHE}"
        )
    with zipfile.ZipFile(path) as z:
        source = z.read(MODULE)
    for pkg in ("vllm", "vllm.config", "vllm.utils", "vllm.v1", "vllm.v1.core"):
        sys.modules.setdefault(pkg, types.ModuleType(pkg))
    _stub("vllm.config.kv_events", KVEventsConfig=_KVEventsConfig)
    _stub("vllm.logger", init_logger=logging.getLogger)
    _stub(
        "vllm.utils.network_utils",
        get_ip=lambda: "127.0.0.1",
        get_tcp_uri=lambda ip, port: f"tcp://{ip}:{port}",
        is_valid_ipv6_address=lambda ip: ":" in ip,
        split_zmq_path=_split_zmq_path,
    )
    _stub("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)
    mod = types.ModuleType("kvcm_bench_vllm_kv_events")
    mod.__file__ = f"{path}/{MODULE}"
    sys.modules[mod.__name__] = mod
    exec(compile(source, mod.__file__, "exec"), mod.__dict__)  # noqa: S102 - vLLM's module
    return mod


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port
