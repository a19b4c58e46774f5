"""The chaos run: every kind of engine with its own sidecar, a seeded nemesis, and a checker.

`python -m sidecar.testbed.chaos --seed N --duration S [--sources ring,plain,c,vllm,sglang]`

Imports: stdlib, aiohttp, sidecar.child, sidecar.testbed.*. Real processes throughout: a
KVCM-compatible server with a state file, one engine of each kind asked for (`ring`: the
reference block cache, which answers snapshots; `plain`: an engine without a snapshot provider;
`c`: the C producer; `vllm` / `sglang`: ZMQ publishers in either format), each with its own
`kvcm-sidecar run`, every link through a FaultProxy. The engines' workloads run throughout.

The nemesis draws its schedule from the seed and prints it first (a failing seed reruns
exactly); faults overlap and each is held for a random time. The checker samples, twice a
second, each engine's truth and what KVCM shows for its host: a key the engine no longer holds
must not stay visible longer than the stale bound (flush window + RTT + periodic snapshot +
the faults that touched that host meanwhile), and a key whose removal KVCM had shown must not
come back while the engine still lacks it. After the nemesis, every link healed and every
process back, each host must converge: KVCM equal to the engine's truth, (key, medium) for
(key, medium). A violation prints the seed, the schedule and the first differing keys with
what the samples saw of them. Exit 0: no violation; 1: violations; 2: bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from sidecar.child import Proc, spawn
from sidecar.testbed.fault_proxy import FaultProxy
from sidecar.testbed.ports import free_port

SOURCES = ("ring", "plain", "c", "vllm", "sglang")
ZMQ_KVCM_MEDIUM = {"GPU": "hbm", "CPU": "mem", "CPU_PINNED": "mem", "DISK": "disk"}
SAMPLE_S = 0.5
STABLE_SAMPLES = 3  # convergence: this many equal samples in a row, 0.25 s apart
HISTORY_SAMPLES = 60  # samples a violation's key history shows (30 s)
LEAK_MIN_S = 300.0  # sidecars that lived this long get a leak figure (a soak's)
LEAK_WARMUP = 1 / 3  # of a sidecar's life: not in its growth figure (see leak_figure)
CONVERGE_S = 30.0
AMBIGUOUS_DELAY_S = 2.5
# The sidecars' settings: quick to notice and to recover, so that a short run sees many cycles.
SIDECAR_SETTINGS = {
    "report.heartbeat_interval_s": "0.2",
    "report.flush_window_s": "0.01",
    "report.backoff_base_s": "0.05",
    "report.backoff_cap_s": "0.5",
    "report.circuit_retry_s": "1",
    # Longer than the slowest reply a kvcm_slow fault holds (1.5 s): a delta that timed out
    # may still land that late, and the reconciling snapshot must come after it (seed 2070).
    "report.ambiguous_snapshot_delay_s": str(AMBIGUOUS_DELAY_S),
    "engine.watch_interval_s": "0.05",
    "engine.stale_after_s": "1.5",
    "manager.request_timeout_s": "0.5",
    "manager.snapshot_timeout_s": "5",
    "shutdown.grace_s": "3",
    "shutdown.host_down_budget_s": "0.3",
    "ring.idle_poll_interval_s": "0.005",
    "source.zmq.replay_timeout_s": "1",
    "source.zmq.checkpoint_interval_s": "0.2",
}
HEARTBEAT_TIMEOUT_MS = 2000
FLUSH_RTT_S = 1.0  # flush window + a request's round trip, with slack for a loaded machine
# With no fault touching a host while a key waited, its removal must show within this: the
# flush window and a round trip, with room for a 2-core machine running the whole test bed.
CALM_BOUND_S = 4.0
KVCM_RESTART_SNAPSHOT_S = 6.0
# The backstop snapshot, longer than the convergence window: a host must converge exactly
# without waiting for it (a stale key it would have hidden is then a finding, not noise).
PERIODIC_SNAPSHOT_S = 60.0
# Faults: kind -> (targets: "sidecar" | "engine" | "zmq" | "ring" | "kvcm", held for (min, max) s)
FAULTS: dict[str, tuple[str, tuple[float, float]]] = {
    "sidecar_kill": ("sidecar", (0.2, 2.0)),  # SIGKILL, restarted after the hold
    "sidecar_stop": ("sidecar", (0.3, 2.5)),  # SIGSTOP, SIGCONT after the hold
    "engine_kill": ("engine", (0.2, 2.0)),  # SIGKILL, a new incarnation after the hold
    "engine_stop": ("engine", (0.3, 3.0)),
    "kvcm_restart": ("kvcm", (0.2, 1.5)),  # with its state file
    "kvcm_reset": ("kvcm", (0.2, 1.5)),  # without it: state loss
    "kvcm_503": ("kvcm", (0.3, 2.0)),
    "kvcm_slow": ("kvcm", (0.5, 3.0)),  # every reportEvent held 0.2-1.5 s
    "kvcm_slow_snapshot": ("kvcm", (1.0, 4.0)),  # snapshots held 1-4 s (big ones are slow)
    "link_partition": ("sidecar", (0.3, 3.0)),  # sidecar <-> KVCM blackholed
    "link_cut": ("sidecar", (0.0, 0.0)),
    "zmq_cut": ("zmq", (0.0, 0.0)),  # publisher <-> sidecar: a gap the replay covers
    "zmq_partition": ("zmq", (0.3, 2.5)),  # the PUB link, or both links, held
    "zmq_restart": ("zmq", (0.0, 0.0)),  # a new engine life: seq back to 0
    "ring_overflow": ("ring", (0.0, 0.0)),  # a burst of 10x the ring
    "checkpoint_unwritable": ("zmq", (0.5, 3.0)),
}


@dataclass
class Fault:
    at: float
    hold: float
    kind: str
    target: str  # a host name, or "kvcm"
    detail: dict[str, Any] = field(default_factory=dict)


def schedule(
    seed: int, duration: float, hosts: list[str], only: list[str] | None = None
) -> list[Fault]:
    """The nemesis' plan, from the seed alone: one fault every 0.4-1.6 s, overlapping (`only`:
    these kinds alone, to focus a long run on one subsystem; [] none: the workload alone)."""
    if only == []:
        return []
    rng = random.Random(seed)
    zmq = [h for h in hosts if h in ("vllm", "sglang")]
    ring = [h for h in hosts if h in ("ring", "plain", "c")]
    kinds = [k for k, (t, _) in FAULTS.items() if (t != "zmq" or zmq) and (t != "ring" or ring)]
    kinds = [k for k in kinds if only is None or k in only] or kinds
    out: list[Fault] = []
    t = rng.uniform(0.5, 1.5)
    while t < duration:
        kind = rng.choice(kinds)
        what, (lo, hi) = FAULTS[kind]
        hold = round(rng.uniform(lo, hi), 3)
        target = {
            "sidecar": rng.choice(hosts),
            "engine": rng.choice(hosts),
            "zmq": rng.choice(zmq) if zmq else "",
            "ring": rng.choice(ring) if ring else "",
            "kvcm": "kvcm",
        }[what]
        detail: dict[str, Any] = {}
        if kind == "kvcm_slow":
            detail["delay_ms"] = rng.randrange(200, 1500)
        if kind == "kvcm_slow_snapshot":
            detail["delay_ms"] = int(hold * 1000)
        if kind == "zmq_partition":
            detail["links"] = rng.choice(["pub", "both"])
        out.append(Fault(round(t, 3), min(hold, max(duration - t, 0.0)), kind, target, detail))
        t += rng.uniform(0.4, 1.6)
    return out


def slope_per_h(pts: list[tuple[float, float]]) -> float:
    """Least-squares slope of (t s, value) points, per hour (0 for fewer than 2 times)."""
    n = len(pts)
    if n < 2:
        return 0.0
    mt = sum(t for t, _ in pts) / n
    mv = sum(v for _, v in pts) / n
    var = sum((t - mt) ** 2 for t, _ in pts)
    return sum((t - mt) * (v - mv) for t, v in pts) / var * 3600 if var else 0.0


def leak_figure(pts: list[tuple[float, int, int, int]]) -> dict[str, Any]:
    """One sidecar's (t, rss_kb, fds, held keys) samples -> its leak figure. Warm-up is the
    first LEAK_WARMUP of its life (tables and allocator pools reach their working size); the
    growth is the least-squares slope of RSS after it, and again over the last third alone: a
    leak keeps its slope, a warm-up's flattens. fds and the engine's held keys over the same
    span tell legit growth (more keys held) from a leak."""
    t0, t1 = pts[0][0], pts[-1][0]
    warm = [p for p in pts if p[0] >= t0 + (t1 - t0) * LEAK_WARMUP]
    last = [p for p in pts if p[0] >= t0 + (t1 - t0) * 2 / 3]
    mb = 1024.0
    return {
        "lived_s": round(t1 - t0, 1),
        "rss_mb_first_last": [round(pts[0][1] / mb, 1), round(pts[-1][1] / mb, 1)],
        "rss_mb_after_warmup": [round(warm[0][1] / mb, 1), round(warm[-1][1] / mb, 1)],
        "rss_growth_mb_per_h": round(slope_per_h([(p[0], p[1] / mb) for p in warm]), 2),
        "rss_growth_last_third_mb_per_h": round(slope_per_h([(p[0], p[1] / mb) for p in last]), 2),
        "rss_growth_net_of_held_mb_per_h": round(net_of_held_per_h(warm), 2),
        "rss_floor_growth_mb_per_h": round(slope_per_h(floor(warm)), 2),
        "fds_after_warmup": [min(p[2] for p in warm), max(p[2] for p in warm)],
        "held_keys_after_warmup": [min(p[3] for p in warm), max(p[3] for p in warm)],
    }


def net_of_held_per_h(pts: list[tuple[float, int, int, int]]) -> float:
    """RSS growth per hour that the engine's held keys do not explain: the time coefficient of a
    least-squares fit of RSS (MB) on time and held keys together. A sidecar whose engine floods
    it (ring_overflow: ~500 -> ~20 000 keys and back) swings by megabytes with its key tables;
    a plain slope over a flood-dense span reads that as growth, this one does not. Equal to the
    plain slope when the held keys do not vary."""
    if len(pts) < 3:
        return slope_per_h([(p[0], p[1] / 1024.0) for p in pts])
    a = np.array([(1.0, p[0] / 3600.0, float(p[3])) for p in pts])
    y = np.array([p[1] / 1024.0 for p in pts])
    if np.ptp(a[:, 2]) == 0:
        a = a[:, :2]
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    return float(coef[1])


def floor(pts: list[tuple[float, int, int, int]], windows: int = 10) -> list[tuple[float, float]]:
    """The lowest RSS (MB) of each of `windows` equal spans, at its time: floods and bursts
    raise RSS for a while and give it back (to the allocator's trim), a leak raises the floor."""
    if len(pts) < 2:
        return [(p[0], p[1] / 1024.0) for p in pts]
    t0, t1 = pts[0][0], pts[-1][0]
    width = (t1 - t0) / windows or 1.0
    lows: dict[int, tuple[float, float]] = {}
    for t, rss, *_ in pts:
        w = min(int((t - t0) / width), windows - 1)
        if w not in lows or rss / 1024.0 < lows[w][1]:
            lows[w] = (t, rss / 1024.0)
    return [lows[w] for w in sorted(lows)]


class Changes:
    """The last HISTORY_SAMPLES samples of one host's (truth, view) as differences from the
    sample before: a key's history replays from the newest sets, in memory that follows the
    churn, not the number of keys held."""

    def __init__(self, depth: int = 0) -> None:
        self.depth = depth or HISTORY_SAMPLES
        self.rows: deque[tuple[float, set[Any], set[Any], set[Any], set[Any]]] = deque()
        self.truth: set[Any] = set()
        self.seen: set[Any] = set()

    def add(self, t: float, truth: set[Any], seen: set[Any]) -> None:
        """A sample: what entered and left the truth and the view since the last one."""
        tr, sn = self.truth, self.seen
        diff = (truth - tr, tr - truth) if truth is not tr else (set(), set())
        self.rows.append((t, *diff, seen - sn, sn - seen))
        self.truth, self.seen = truth, seen
        while len(self.rows) > self.depth:
            self.rows.popleft()

    def rows_for(self, key: Any) -> list[tuple[float, bool, bool]]:
        """(t, engine holds key, KVCM shows key) per sample kept, oldest first."""
        held, shown = key in self.truth, key in self.seen
        out: list[tuple[float, bool, bool]] = []
        for t, t_in, t_out, s_in, s_out in reversed(self.rows):
            out.append((round(t, 2), held, shown))
            held = (held and key not in t_in) or key in t_out  # as it was before this sample
            shown = (shown and key not in s_in) or key in s_out
        return out[::-1]


# ---- the world ---------------------------------------------------------------------------
class Kvcm:
    """The KVCM-compatible server as a child process on a fixed port, restartable."""

    def __init__(self, root: Path, tasks: list[asyncio.Task[None]]) -> None:
        self.port = free_port()
        self.state_file = root / "kvcm-state.json"
        self.tasks = tasks
        self.proc: Proc | None = None
        self.url = f"http://127.0.0.1:{self.port}"
        self.restarting = asyncio.Lock()

    async def start(self) -> None:
        self.proc = await spawn(
            "kvcm",
            sys.executable,
            "-m",
            "sidecar.cli",
            "kvcm-server",
            "--meta-port",
            str(self.port),
            "--bootstrap",
            "--state-file",
            str(self.state_file),
            "--snapshot-min-interval-ms",
            "500",
            "--heartbeat-timeout-ms",
            str(HEARTBEAT_TIMEOUT_MS),
            "--cleanup-grace-ms",
            "20000",
            tasks=self.tasks,
        )
        # 60 s: a restart on a 2-core machine at load 15-20 took longer than 30 (a soak died)
        await self.proc.expect(lambda x: isinstance(x, str) and "listening on" in x, 60)

    async def stop(self, lose_state: bool = False) -> None:
        if self.proc is not None:
            try:
                await self.proc.stop(signal.SIGTERM)  # the state file is written at shutdown
            except TimeoutError:
                await self.proc.stop(signal.SIGKILL)  # a crash, then: what was saved survives
            self.proc = None
        if lose_state:
            self.state_file.unlink(missing_ok=True)

    async def faults(self, s: aiohttp.ClientSession, body: dict[str, Any]) -> None:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with s.post(f"{self.url}/debug/faults", json=body, timeout=_T2) as r:
                await r.read()

    async def view(self, s: aiohttp.ClientSession) -> dict[str, set[tuple[int, str]]] | None:
        """host_ip_port -> visible (key, medium); None while the server does not answer."""
        try:
            async with s.get(f"{self.url}/debug/reporters", timeout=_T5) as r:
                data = await r.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
        out: dict[str, set[tuple[int, str]]] = {}
        for rep in data["reporters"]:
            out.setdefault(rep["host_ip_port"], set()).update(
                (int(k), m) for k, m in rep["visible"]
            )
        return out


_T2 = aiohttp.ClientTimeout(total=2)
_T5 = aiohttp.ClientTimeout(total=5)


class Host:
    """One engine, its sidecar and their links. Subclasses: how the engine runs and reports."""

    kind = ""

    def __init__(self, name: str, run: Run) -> None:
        self.name = name
        self.run = run
        self.instance_id = f"chaos-{name}"
        self.host_ip_port = f"127.0.0.1:{free_port()}"
        self.state_dir = run.root / f"state-{name}"
        self.state_dir.mkdir()
        self.kvcm_link: FaultProxy | None = None
        self.sidecar: Proc | None = None
        self.engine_down = False
        self.engine_paused = False
        self.sidecar_paused = False
        self.truth: set[tuple[int, str]] = set()
        self.truth_at = 0.0
        self.incarnations = 0
        # One lifecycle fault at a time per process: a second kill of a sidecar being
        # restarted would start two sidecars for one identity (the second exits 3).
        self.sidecar_busy = asyncio.Lock()
        self.metrics_port = 0
        self.engine_busy = asyncio.Lock()

    # engine side (subclasses)
    async def start_engine(self) -> None:
        raise NotImplementedError

    async def kill_engine(self) -> None:
        raise NotImplementedError

    def engine_pid(self) -> int | None:
        raise NotImplementedError

    async def work(self) -> None:
        """One workload step (updates `truth`)."""
        raise NotImplementedError

    async def quiesce(self) -> set[tuple[int, str]]:
        """Stop the workload; the engine's final truth."""
        raise NotImplementedError

    def sidecar_settings(self) -> dict[str, str]:
        raise NotImplementedError

    # sidecar side
    async def start_sidecar(self) -> None:
        assert self.kvcm_link is not None
        settings = {
            **SIDECAR_SETTINGS,
            "manager.endpoint": f"http://{self.kvcm_link.address}",
            "identity.instance_id": self.instance_id,
            "identity.host_ip_port": self.host_ip_port,
            "identity.lock_dir": str(self.run.root),
            "http.metrics_addr": "127.0.0.1:0",
            "log.format": "json",
            "source.state_dir": str(self.state_dir),
            "report.periodic_snapshot_s": str(PERIODIC_SNAPSHOT_S),
            **self.sidecar_settings(),
        }
        # -P: the interpreter's own `sidecar` (--sidecar-python), never the one in the cwd
        argv = [self.run.sidecar_python, "-P", "-m", "sidecar.cli", "run"]
        for k, v in settings.items():
            argv += ["--set", f"{k}={v}"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KV_CACHE_EVENT_")}
        self.sidecar = p = await spawn(f"sidecar-{self.name}", *argv, env=env, tasks=self.run.tasks)
        try:
            line = await p.expect(
                lambda x: isinstance(x, dict) and "http listening" in str(x.get("msg", "")), 30
            )
            self.metrics_port = int(line["msg"].rsplit(":", 1)[1])
        except TimeoutError:
            tail = [p.lines.get_nowait() for _ in range(p.lines.qsize())][-10:]
            raise RuntimeError(
                f"sidecar {self.name} did not start (rc={p.p.returncode}): {tail}"
            ) from None

    def sidecar_pid(self) -> int | None:
        p = self.sidecar
        return p.p.pid if p is not None and p.p.returncode is None else None

    async def kill_sidecar(self) -> None:
        if self.sidecar is not None:
            await self.sidecar.stop(signal.SIGKILL)
            self.sidecar = None


class RingHost(Host):
    """A ring engine (sidecar/testbed/ring_engine.py `cache` or `plain`, or the C producer)."""

    def __init__(self, name: str, run: Run) -> None:
        super().__init__(name, run)
        self.ring = f"/kvcm-chaos-{os.getpid()}-{name}"
        self.engine: Proc | None = None
        self.capacity = 4096
        self.seed = run.seed * 100 + SOURCES.index(name)
        self.lock = asyncio.Lock()  # one command in flight

    def argv(self) -> list[str]:
        args = {
            "ring": self.ring,
            "instance_id": self.instance_id,
            "capacity": self.capacity,
            "seed": self.seed + self.incarnations,
            "blocks": self.run.keys,
            # A big cache is not reset every few hundred operations: it fills (to ~65 % of
            # 4 x keys) and churns, so its snapshots are as big as a busy engine's.
            "clear_prob": 0.003 if self.run.keys < 4096 else 0.0,
        }
        if self.name == "c":
            assert self.run.c_engine is not None
            return [str(self.run.c_engine), "cache", self.ring, self.instance_id]
        mode = "cache" if self.name == "ring" else "plain"
        return [sys.executable, "-m", "sidecar.testbed.ring_engine", mode, json.dumps(args)]

    async def start_engine(self) -> None:
        argv = self.argv()
        if self.name == "c":
            argv += [str(self.capacity), str(self.seed + self.incarnations), "1"]
        self.engine = await spawn(f"engine-{self.name}", *argv, tasks=self.run.tasks)
        ready = await self.engine.expect(lambda x: isinstance(x, dict) and "ready" in x, 30)
        assert ready["ready"], ready
        self.incarnations += 1
        self.engine_down = False
        self.truth, self.truth_at = set(), time.monotonic()

    async def kill_engine(self) -> None:
        async with self.lock:
            if self.engine is not None:
                await self.engine.stop(signal.SIGKILL)
                self.engine = None
            self.engine_down = True
            self.truth, self.truth_at = set(), time.monotonic()  # its cache died with it

    def engine_pid(self) -> int | None:
        e = self.engine
        return e.p.pid if e is not None and e.p.returncode is None else None

    async def command(self, **cmd: Any) -> None:
        async with self.lock:
            e = self.engine
            if e is None or self.engine_paused:
                return
            e.new_stats.clear()
            await e.send(json.dumps(cmd))
            async with asyncio.timeout(60):
                while "published" not in e.last or not e.new_stats.is_set():
                    await e.new_stats.wait()  # a reply carries stats: Proc keeps it as `last`
            reply = e.last
            e.last = {}
            self.truth = {(int(k), "hbm") for k in reply["published"]}
            self.truth_at = time.monotonic()

    async def work(self) -> None:
        scale = max(1, self.run.keys // 2000)  # a bigger cache fills as fast
        await self.command(op="work", n=self.run.rng_work.randrange(5, 40) * scale)

    async def flood(self) -> None:
        await self.command(op="flood", n=self.capacity * 10)

    async def quiesce(self) -> set[tuple[int, str]]:
        await self.command(op="work", n=1)
        return set(self.truth)

    def sidecar_settings(self) -> dict[str, str]:
        return {"source.kind": "ring", "ring.name": self.ring}


class ZmqHost(Host):
    """A vLLM- or SGLang-format ZMQ publisher (sidecar/testbed/zmq_publisher.py), its PUB and
    replay links through proxies."""

    def __init__(self, name: str, run: Run) -> None:
        super().__init__(name, run)
        self.pub_port, self.rep_port = free_port(), free_port()
        self.pub_link: FaultProxy | None = None
        self.rep_link: FaultProxy | None = None
        self.engine: Any = None  # PublisherProcess
        self.calls = asyncio.Lock()
        self.hidden_dir: Path | None = None

    async def start_engine(self) -> None:
        from sidecar.testbed.zmq_publisher import PublisherProcess

        def start() -> Any:
            return PublisherProcess(
                flavour=self.name,
                encoding="positional" if self.name == "sglang" else "map",
                endpoint=f"tcp://127.0.0.1:{self.pub_port}",
                replay_endpoint=f"tcp://127.0.0.1:{self.rep_port}",
                bind=True,
            )

        self.engine = await asyncio.to_thread(start)
        self.incarnations += 1
        self.engine_down = False
        self.truth, self.truth_at = set(), time.monotonic()
        await self.call(
            "workload",
            events=0,
            rate=self.run.zmq_rate,
            batch_events=4,
            blocks_per_event=2,
            mediums=["GPU", "CPU"] if self.name == "vllm" else ["GPU", "CPU_PINNED"],
            max_held=self.run.keys,
            dup_prob=0.2,
            seed=self.run.seed * 100 + self.incarnations,
        )

    async def call(self, cmd: str, **kw: Any) -> dict[str, Any] | None:
        async with self.calls:  # one command at a time: replies come back in order
            e = self.engine
            if e is None or self.engine_paused:
                return None
            out: dict[str, Any] = await asyncio.to_thread(e.call, cmd, 30.0, **kw)
            return out

    async def kill_engine(self) -> None:
        e, self.engine = self.engine, None
        if e is not None:
            await asyncio.to_thread(e.kill)
        self.engine_down = True
        self.truth, self.truth_at = set(), time.monotonic()

    def engine_pid(self) -> int | None:
        e = self.engine
        return e.p.pid if e is not None and e.p.poll() is None else None

    def _held(self, truth: dict[str, Any]) -> set[tuple[int, str]]:
        return {(int(k), ZMQ_KVCM_MEDIUM.get(m, m)) for k, m, *_ in truth["held"]}

    async def work(self) -> None:
        t = await self.call("truth", group=0)
        if t is not None:
            self.truth, self.truth_at = self._held(t), time.monotonic()

    async def quiesce(self) -> set[tuple[int, str]]:
        if self.engine is not None:
            await self.call("stop")
            await self.work()
        return set(self.truth)

    def sidecar_settings(self) -> dict[str, str]:
        assert self.pub_link is not None and self.rep_link is not None
        return {
            "source.kind": "zmq",
            "source.zmq.endpoint": f"tcp://{self.pub_link.address}",
            "source.zmq.replay_endpoint": f"tcp://{self.rep_link.address}",
            "source.zmq.bind": "false",
        }

    def checkpoint_unwritable(self) -> None:
        """The state directory becomes a file (root ignores mode bits: a chmod would not do)."""
        if self.hidden_dir is None:
            self.hidden_dir = self.state_dir.with_name(self.state_dir.name + ".hidden")
            self.state_dir.rename(self.hidden_dir)
            self.state_dir.write_text("not a directory\n")

    def checkpoint_writable(self) -> None:
        if self.hidden_dir is not None:
            self.state_dir.unlink()
            self.hidden_dir.rename(self.state_dir)
            self.hidden_dir = None


# ---- the run -----------------------------------------------------------------------------
@dataclass
class Violation:
    kind: str  # stale | resurrected | diverged
    host: str
    at: float
    keys: list[Any]
    detail: dict[str, Any] = field(default_factory=dict)


class Run:
    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        self.seed: int = args.seed
        self.duration: float = args.duration
        self.sources: list[str] = args.sources
        self.keys: int = args.keys
        self.zmq_rate: float = args.zmq_rate
        self.sidecar_python: str = args.sidecar_python or sys.executable
        self.root = root
        self.tasks: list[asyncio.Task[None]] = []
        self.kvcm = Kvcm(root, self.tasks)
        self.hosts: dict[str, Host] = {}
        self.plan = schedule(self.seed, self.duration, list(self.sources), args.faults)
        self.rng_work = random.Random(self.seed ^ 0x5EED)
        self.c_engine: Path | None = None
        self.t0 = 0.0
        self.started = False  # the world is up and the nemesis may begin (main() retries before)
        self.violations: list[Violation] = []
        self.injected: dict[str, int] = {}
        self.active: list[list[Any]] = []  # [start, end, target] of faults (begin, healed)
        self.stale_since: dict[str, dict[tuple[int, str], float]] = {}
        self.gone: dict[str, set[tuple[int, str]]] = {}  # removals KVCM was seen to apply
        self.history: dict[str, list[tuple[float, set[Any], set[Any]]]] = {}  # the last 3
        self.changes: dict[str, Changes] = {}  # what key_history reads, as differences
        self.resources: list[dict[str, Any]] = []
        self.stop_work = asyncio.Event()
        self.calm_bound_s: float = args.calm_bound_s
        self.back_since: dict[str, dict[tuple[int, str], float]] = {}
        self.stale_after_hiding: dict[str, int] = {}  # keys only the hidden span's faults excused
        self.excused: dict[str, set[tuple[int, str]]] = {}  # those keys (counted once each)
        self.hidden_from: dict[str, float] = {}  # the host's reporter hidden since (check_sample)
        self.bound_from: dict[str, dict[tuple[int, str], float]] = {}  # a stale key's faults from

    def now(self) -> float:
        return time.monotonic() - self.t0

    def say(self, **obj: Any) -> None:
        sys.stdout.write(json.dumps(obj, default=str) + "\n")
        sys.stdout.flush()

    def track(self, name: str) -> None:
        """The checker's state for one host."""
        self.stale_since[name] = {}
        self.bound_from[name] = {}
        self.gone[name] = set()
        self.back_since[name] = {}
        self.history[name] = []
        self.changes[name] = Changes()

    async def setup(self) -> None:
        if "c" in self.sources:
            from sidecar.testbed import cbuild

            self.c_engine = await asyncio.to_thread(cbuild.build, "kvcm_test_engine.c")
        await self.kvcm.start()
        for name in self.sources:
            h: Host = ZmqHost(name, self) if name in ("vllm", "sglang") else RingHost(name, self)
            h.kvcm_link = await FaultProxy("127.0.0.1", self.kvcm.port).start()
            if isinstance(h, ZmqHost):
                h.pub_link = await FaultProxy("127.0.0.1", h.pub_port).start()
                h.rep_link = await FaultProxy("127.0.0.1", h.rep_port).start()
            self.hosts[name] = h
            self.track(name)
        for h in self.hosts.values():
            await h.start_engine()
            await h.start_sidecar()

    async def teardown(self) -> None:
        for h in self.hosts.values():
            for pid in (h.engine_pid(), h.sidecar_pid()):
                if pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
            if isinstance(h, ZmqHost):
                h.checkpoint_writable()
            if h.sidecar is not None:
                with contextlib.suppress(TimeoutError, ProcessLookupError):
                    await h.sidecar.stop(signal.SIGKILL)
            if isinstance(h, RingHost) and h.engine is not None:
                with contextlib.suppress(TimeoutError, ProcessLookupError):
                    await h.engine.stop(signal.SIGKILL)
            if isinstance(h, ZmqHost) and h.engine is not None:
                await asyncio.to_thread(h.engine.close)
            for link in (h.kvcm_link, getattr(h, "pub_link", None), getattr(h, "rep_link", None)):
                if link is not None:
                    await link.close()
            if isinstance(h, RingHost):
                from sidecar.shm_ring.segment import unlink

                unlink(h.ring)
        with contextlib.suppress(TimeoutError, ProcessLookupError):
            await self.kvcm.stop()
        for t in self.tasks:
            t.cancel()

    # ---- workloads and the checker's samples ------------------------------------------
    async def workload(self, h: Host) -> None:
        while not self.stop_work.is_set():
            if not h.engine_down and not h.engine_paused:
                with contextlib.suppress(TimeoutError, EOFError, OSError, RuntimeError, ValueError):
                    await h.work()
            await asyncio.sleep(0.05 if isinstance(h, RingHost) else 0.2)  # the engine's pace

    def bound(self, name: str, since: float, now: float) -> float:
        """How long a removed key may stay visible: flush + RTT + the periodic snapshot + the
        faults that touched this host (or KVCM) while it waited, + KVCM's liveness timeout
        when one did (a dead sidecar's keys stay until then)."""
        touched: float = sum(
            min(end, now) - max(start, since)
            for start, end, target in self.active
            if target in (name, "kvcm") and start < now and end > since
        )
        if not touched:
            return self.calm_bound_s  # no fault in the way: a removal shows within a flush
        liveness = HEARTBEAT_TIMEOUT_MS / 1000 + 1.0
        return FLUSH_RTT_S + PERIODIC_SNAPSHOT_S + touched + liveness

    async def sampler(self, s: aiohttp.ClientSession) -> None:
        while not self.stop_work.is_set():
            view = await self.kvcm.view(s)
            now = self.now()
            if view is not None:
                for name, h in self.hosts.items():
                    self.check_sample(name, h, view.get(h.host_ip_port, set()), now)
            self.sample_resources(now)
            await asyncio.sleep(SAMPLE_S)

    def check_sample(self, name: str, h: Host, seen: set[Any], now: float) -> None:
        truth = h.truth
        hist = self.history[name]
        hist.append((now, truth, seen))
        # Three full samples (what the checks read): every sample's sets kept 400 deep were
        # most of the 3.3 GB this process held in an hour-long soak (20-45 k keys per set).
        del hist[:-3]
        self.changes[name].add(now, truth, seen)
        stale = self.stale_since[name]
        extra = seen - truth
        for k in list(stale):
            # A key keeps its timer while its reporter is hidden (nothing of the host shows:
            # a missed heartbeat), and loses it once the engine holds it or KVCM dropped it.
            if k not in extra and (k in truth or seen):
                del stale[k]
        # While the reporter was hidden (the engine holds keys, KVCM shows none of them: a
        # restarted KVCM hides what it restored until the reporter's first event) nothing
        # told whether a key was stale. One first shown stale as the reporter reappears may
        # have been all along, so the faults since it hid count toward its bound (the soak's
        # seed 6300: a KVCM restart, 503s and a ring overflow; the restored entries first
        # showed after every one of those windows had closed). Its timer starts as before.
        reappeared = self.hidden_from.pop(name, None) if seen else None
        if not seen and truth:
            self.hidden_from.setdefault(name, now)
        first_shown = self.bound_from[name]
        for k in list(first_shown):
            if k not in stale:
                del first_shown[k]
        late: list[Any] = []
        for k in extra:
            if k not in stale:
                stale[k] = now
                if reappeared is not None:
                    first_shown[k] = reappeared
            since = stale[k]
            if now - since > self.bound(name, min(since, first_shown.get(k, since)), now):
                late.append(k)
            elif k in first_shown and now - since > self.bound(name, since, now):
                # within its bound only for the faults while hidden: said in the summary, once
                excused = self.excused.setdefault(name, set())
                if k not in excused:
                    excused.add(k)
                    self.stale_after_hiding[name] = self.stale_after_hiding.get(name, 0) + 1
        if late:
            self.violate("stale", name, now, sorted(late)[:10], since=min(stale[k] for k in late))
            for k in late:
                stale[k] = now  # reported once per bound, not at every sample
        # A removal KVCM was seen to apply (gone from the view and from the truth); such a
        # key back in the view, while the engine still lacks it, is a resurrection. Under a
        # fault on this host the stale bound judges it instead (a removal can lag then).
        gone = self.gone[name]
        calm = not any(t in (name, "kvcm") and s0 <= now <= e0 for s0, e0, t in self.active)
        back = {k for k in gone & seen if k not in truth} if calm else set()
        back_at = self.back_since[name]
        for k in list(back_at):
            if k not in back:
                del back_at[k]
        # Back for longer than a removal takes to show (a re-store and remove between two
        # samples, the second one lagging, looks like a return for a moment).
        late = [k for k in back if now - back_at.setdefault(k, now) > self.calm_bound_s]
        if late:
            self.violate("resurrected", name, now, sorted(late)[:10])
            gone.difference_update(late)
        gone -= truth
        if len(hist) >= 3 and calm and seen:  # the reporter visible: a removal, not a hiding
            (_, t1, s1), (_, t2, s2) = hist[-3], hist[-2]
            # One union, not one per key: rebuilt per key it made a mass removal (a flood's
            # half, a clear: 20 k keys of 45 k held) quadratic, minutes with the loop blocked.
            gone |= (s1 - s2 - seen) - (t1 | t2 | truth)
        if len(gone) > 200_000:
            gone.clear()

    def violate(self, kind: str, host: str, at: float, keys: list[Any], **detail: Any) -> None:
        v = Violation(kind, host, round(at, 3), keys, detail)
        self.violations.append(v)
        self.say(violation=asdict(v), history=self.key_history(host, keys[:3]))

    def key_history(self, host: str, keys: list[Any]) -> dict[str, Any]:
        """What the samples saw of these keys: when the engine held them, when KVCM showed them."""
        out: dict[str, Any] = {}
        for k in keys:
            rows = self.changes[host].rows_for(k)
            changes = [r for i, r in enumerate(rows) if i == 0 or r[1:] != rows[i - 1][1:]]
            out[str(k)] = {"(t, engine_holds, kvcm_shows)": changes}
        return out

    def sample_resources(self, now: float) -> None:
        row: dict[str, Any] = {"t": round(now, 2)}
        for name, h in self.hosts.items():
            pid = h.sidecar_pid()
            if pid is None:
                continue
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                rss = next(int(x.split()[1]) for x in status.splitlines() if x.startswith("VmRSS"))
                fds = len(os.listdir(f"/proc/{pid}/fd"))
            except (OSError, StopIteration, ValueError):
                continue
            # held: the engine's truth, what the sidecar's key state must hold (legit growth)
            row[name] = {"rss_kb": rss, "fds": fds, "pid": pid, "held": len(h.truth)}
        self.resources.append(row)

    def leaks(self) -> dict[str, Any]:
        """Per sidecar process that lived at least LEAK_MIN_S: leak_figure() of its samples."""
        series: dict[tuple[str, int], list[tuple[float, int, int, int]]] = {}
        for row in self.resources:
            for name, v in row.items():
                if name != "t":
                    series.setdefault((name, v["pid"]), []).append(
                        (row["t"], v["rss_kb"], v["fds"], v.get("held", 0))
                    )
        return {
            f"{name}:{pid}": leak_figure(pts)
            for (name, pid), pts in series.items()
            if pts[-1][0] - pts[0][0] >= LEAK_MIN_S
        }

    # ---- the nemesis ----------------------------------------------------------------------
    async def nemesis(self, s: aiohttp.ClientSession) -> None:
        running: list[asyncio.Task[None]] = []
        for f in self.plan:
            delay = f.at - self.now()
            if delay > 0:
                await asyncio.sleep(delay)  # the schedule's own clock
            self.injected[f.kind] = self.injected.get(f.kind, 0) + 1
            running.append(asyncio.create_task(self.injected_for_its_window(s, f)))
        await asyncio.gather(*running, return_exceptions=False)
        if (rest := self.duration - self.now()) > 0:
            await asyncio.sleep(rest)  # the workloads run for the whole duration

    def begin(self, f: Fault) -> list[Any]:
        """A fault's window of effects, [start, end, target], from its injection: its hold and
        then its aftermath."""
        now = self.now()
        window: list[Any] = [now, now + self.aftermath(f), f.target]
        self.active.append(window)
        return window

    def healed(self, window: list[Any], f: Fault) -> None:
        """The injection has ended: the aftermath counts from here if that is later. A KVCM
        restart on a loaded machine takes seconds to save, exit and listen again, and what
        follows it (re-registration, the snapshots that replace what it persisted) starts
        only then; counted from the injection, its window had closed before the stale
        entries it restored were first shown (the soak's seed 6300)."""
        window[1] = max(window[1], self.now() + self.aftermath(f) - f.hold)

    async def injected_for_its_window(self, s: aiohttp.ClientSession, f: Fault) -> None:
        window = self.begin(f)
        try:
            await self.inject(s, f)
        finally:
            self.healed(window, f)

    @staticmethod
    def aftermath(f: Fault) -> float:
        """How long a fault's effects may last: its hold, then what follows it (a held
        request lands after its client gave up; a dead reporter stays visible until KVCM's
        liveness timeout; an ambiguous request's reconciling snapshot waits)."""
        tail = 0.5 + FLUSH_RTT_S
        if f.kind in ("kvcm_slow", "kvcm_slow_snapshot"):
            tail += f.detail["delay_ms"] / 1000 + AMBIGUOUS_DELAY_S
        if f.kind in ("sidecar_kill", "sidecar_stop", "link_partition", "engine_kill"):
            tail += HEARTBEAT_TIMEOUT_MS / 1000 + 1.5  # + engine.stale_after_s
        if f.kind in ("kvcm_restart", "kvcm_reset"):
            # A restarted KVCM shows the metadata it persisted, stale entries included, until
            # each reporter's next snapshot commits (KVCM's own semantics, contract §12): the
            # sidecar's re-registration, backoff, the snapshot rate limit and its round trip.
            tail += KVCM_RESTART_SNAPSHOT_S
        return f.hold + tail

    async def inject(self, s: aiohttp.ClientSession, f: Fault) -> None:
        h = self.hosts.get(f.target)
        k = f.kind
        if k == "sidecar_kill" and h is not None and h.sidecar is not None:
            if h.sidecar_busy.locked():
                return
            async with h.sidecar_busy:
                await h.kill_sidecar()
                await asyncio.sleep(f.hold)
                await h.start_sidecar()
        elif k in ("sidecar_stop", "engine_stop") and h is not None:
            pid = h.sidecar_pid() if k == "sidecar_stop" else h.engine_pid()
            if pid is None:
                return
            flag = "sidecar_paused" if k == "sidecar_stop" else "engine_paused"
            if getattr(h, flag):
                return
            setattr(h, flag, True)
            os.kill(pid, signal.SIGSTOP)
            await asyncio.sleep(f.hold)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
            setattr(h, flag, False)
        elif k == "engine_kill" and h is not None and not h.engine_down and not h.engine_paused:
            if h.engine_busy.locked():
                return
            async with h.engine_busy:
                await h.kill_engine()
                await asyncio.sleep(f.hold)
                await h.start_engine()
        elif k in ("kvcm_restart", "kvcm_reset"):
            if self.kvcm.restarting.locked():
                return  # one restart at a time: the port is the server's own
            async with self.kvcm.restarting:
                await self.kvcm.stop(lose_state=k == "kvcm_reset")
                await asyncio.sleep(f.hold)
                await self.kvcm.start()
        elif k == "kvcm_503":
            route = {"reportEvent": {"count": -1, "status": 503}}
            await self.kvcm.faults(s, {"routes": route})
            await asyncio.sleep(f.hold)
            await self.kvcm.faults(s, {"clear": True})
        elif k in ("kvcm_slow", "kvcm_slow_snapshot"):
            rule: dict[str, Any] = {"count": -1, "delay_ms": f.detail["delay_ms"]}
            if k == "kvcm_slow_snapshot":
                rule["event"] = "EVENT_BLOCK_SNAPSHOT"
            await self.kvcm.faults(s, {"routes": {"reportEvent": rule}})
            await asyncio.sleep(f.hold)
            await self.kvcm.faults(s, {"clear": True})
        elif k in ("link_partition", "link_cut") and h is not None and h.kvcm_link is not None:
            if k == "link_cut":
                h.kvcm_link.cut()
                return
            h.kvcm_link.blackhole()
            await asyncio.sleep(f.hold)
            h.kvcm_link.heal()
        elif isinstance(h, ZmqHost):
            await self.inject_zmq(h, f)
        elif k == "ring_overflow" and isinstance(h, RingHost):
            with contextlib.suppress(TimeoutError, EOFError, OSError):
                await h.flood()

    async def inject_zmq(self, h: ZmqHost, f: Fault) -> None:
        assert h.pub_link is not None and h.rep_link is not None
        if f.kind == "zmq_cut":
            h.pub_link.cut()
        elif f.kind == "zmq_partition":
            links = [h.pub_link] + ([h.rep_link] if f.detail["links"] == "both" else [])
            for link in links:
                link.blackhole()
            await asyncio.sleep(f.hold)
            for link in links:
                link.heal()
        elif f.kind == "zmq_restart" and not h.engine_down:
            with contextlib.suppress(TimeoutError, EOFError, OSError, RuntimeError, ValueError):
                await h.call("restart")
        elif f.kind == "checkpoint_unwritable":
            h.checkpoint_unwritable()
            await asyncio.sleep(f.hold)
            h.checkpoint_writable()

    # ---- the end: heal, quiesce, converge ------------------------------------------------
    async def converge(self, s: aiohttp.ClientSession) -> dict[str, Any]:
        for h in self.hosts.values():
            for link in (h.kvcm_link, getattr(h, "pub_link", None), getattr(h, "rep_link", None)):
                if link is not None:
                    link.heal()
            if h.engine_down:
                await h.start_engine()
            if h.sidecar is None:
                await h.start_sidecar()
        await self.kvcm.faults(s, {"clear": True})
        truths = {name: await h.quiesce() for name, h in self.hosts.items()}
        t_heal = time.monotonic()
        left = set(self.hosts)
        seen: dict[str, set[Any]] = {}
        deadline = t_heal + CONVERGE_S
        took: dict[str, float] = {}
        equal: dict[str, int] = dict.fromkeys(self.hosts, 0)
        while left and time.monotonic() < deadline:
            view = await self.kvcm.view(s)
            if view is not None:
                for name in list(left):
                    seen[name] = view.get(self.hosts[name].host_ip_port, set())
                    if seen[name] != truths[name]:
                        equal[name] = 0
                        continue
                    equal[name] += 1
                    took.setdefault(name, round(time.monotonic() - t_heal, 3))
                    # Equal on STABLE_SAMPLES samples in a row, with no recovery still under
                    # way: one moment of equality could be a state passing through.
                    if equal[name] >= STABLE_SAMPLES and await self.settled(s, name):
                        left.discard(name)
                for name in left:
                    if equal[name] == 0:
                        took.pop(name, None)
            await asyncio.sleep(0.25)  # polling another process, bounded by the deadline
        for name in sorted(left):
            want, got = truths[name], seen.get(name, set())
            status: dict[str, Any] = {}
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                port = self.hosts[name].metrics_port
                async with s.get(f"http://127.0.0.1:{port}/status", timeout=_T2) as r:
                    status = await r.json(content_type=None)
            keep = ("state", "reason", "resyncs", "zmq_forgets", "zmq_replays", "zmq_recovery")
            arrivals: dict[str, Any] = {}
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                url = f"{self.kvcm.url}/debug/arrivals?host={self.hosts[name].host_ip_port}"
                async with s.get(url, timeout=_T5) as r:
                    times = await r.json(content_type=None)
                first = sorted(want ^ got)[:3]
                arrivals = {str(k): times.get(str(k[0]), []) for k in first}
            self.violate(
                "diverged",
                name,
                self.now(),
                sorted(want ^ got)[:10],
                missing=len(want - got),
                extra=len(got - want),
                sidecar_status={k: status[k] for k in keep if k in status},
                # what KVCM was sent of the first keys (request arrival times, its clock)
                kvcm_arrivals=arrivals,
                sidecar_log_tail=self.sidecar_tail(name),
            )
        return {"converged_s": took, "held": {n: len(t) for n, t in truths.items()}}

    async def settled(self, s: aiohttp.ClientSession, name: str) -> bool:
        """The sidecar reports no recovery or replay under way (its /status)."""
        try:
            port = self.hosts[name].metrics_port
            async with s.get(f"http://127.0.0.1:{port}/status", timeout=_T2) as r:
                st = await r.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return False
        recovering = bool(st.get("zmq_recovery", {}).get("pending"))
        return not recovering and st.get("engine_sync", "synced") == "synced"

    def sidecar_tail(self, name: str) -> list[Any]:
        p = self.hosts[name].sidecar
        if p is None:
            return []
        items: list[Any] = []
        while not p.lines.empty():
            items.append(p.lines.get_nowait())
        return [x.get("msg") if isinstance(x, dict) else x for x in items[-15:]]

    async def main(self) -> dict[str, Any]:
        self.say(seed=self.seed, duration=self.duration, sources=self.sources)
        for f in self.plan:
            self.say(fault=asdict(f))
        async with aiohttp.ClientSession() as s:
            try:
                await self.setup()
                self.started = True
                self.t0 = time.monotonic()
                work = [asyncio.create_task(self.workload(h)) for h in self.hosts.values()]
                sampler = asyncio.create_task(self.sampler(s))
                await self.nemesis(s)
                self.stop_work.set()
                await asyncio.gather(*work, sampler)
                end = await self.converge(s)
            finally:
                await self.teardown()
        summary = {
            "seed": self.seed,
            "duration_s": self.duration,
            "sources": self.sources,
            "faults": dict(sorted(self.injected.items())),
            "violations": [asdict(v) for v in self.violations],
            "stale_after_hiding": dict(sorted(self.stale_after_hiding.items())),
            **end,
            "leaks": self.leaks(),
            "resources": self.resources[:: max(1, len(self.resources) // 40)],
        }
        self.say(summary=summary)
        return summary


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m sidecar.testbed.chaos", description=__doc__)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of faults")
    ap.add_argument("--sources", default=",".join(SOURCES), help=f"any of {','.join(SOURCES)}")
    ap.add_argument("--keys", type=int, default=512, help="ring cache blocks / ZMQ window")
    ap.add_argument("--zmq-rate", type=float, default=400.0, help="ZMQ block events per second")
    ap.add_argument("--json", type=Path, help="write the summary here")
    ap.add_argument("--sidecar-python", help="the interpreter whose `sidecar` runs as the sidecars")
    ap.add_argument("--seeds", type=int, default=1, help="run this many seeds from --seed on")
    ap.add_argument(
        "--calm-bound-s",
        type=float,
        default=CALM_BOUND_S,
        help="how long a removal may take to show on a host no fault touches (raise it on a "
        "machine busy with more than this run)",
    )
    ap.add_argument(
        "--faults", help=f"only these fault kinds (of {','.join(FAULTS)}), or none (no nemesis)"
    )
    args = ap.parse_args(argv)
    # "none": the workloads without a nemesis (a leak baseline: what grows without faults)
    args.faults = [] if args.faults == "none" else args.faults.split(",") if args.faults else None
    if args.faults and (unknown := [f for f in args.faults if f not in FAULTS]):
        ap.error(f"--faults: unknown {unknown}")
    args.sources = [x for x in args.sources.split(",") if x]
    bad = [x for x in args.sources if x not in SOURCES]
    if bad or not args.sources:
        ap.error(f"--sources: unknown {bad} (choose from {', '.join(SOURCES)})")
    if args.duration <= 0 or args.keys < 16 or args.seeds < 1:
        ap.error("--duration must be > 0, --keys >= 16, --seeds >= 1")
    return args


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM as ^C: the run's teardown still stops every child


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    summaries = []
    first = args.seed
    for seed in range(first, first + args.seeds):
        args.seed = seed
        for attempt in range(3):
            root = Path(tempfile.mkdtemp(prefix=f"kvcm-chaos-{seed}-"))
            run = Run(args, root)
            try:
                summaries.append(asyncio.run(run.main()))
                break
            except (OSError, EOFError, TimeoutError) as exc:
                # A world that could not start (a port another process took between its pick
                # and its bind) is not a finding: the seed runs again on new ports. Once the
                # nemesis has begun, nothing is retried.
                if run.started or attempt == 2:
                    raise
                run.say(setup_retry={"seed": seed, "error": repr(exc)})
            finally:
                shutil.rmtree(root, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(summaries if args.seeds > 1 else summaries[0], indent=1))
    return 1 if any(s["violations"] for s in summaries) else 0


if __name__ == "__main__":
    sys.exit(main())
