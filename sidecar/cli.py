"""`kvcm-sidecar` command line: the only place that reads the environment, configures logging,
installs signal handlers, picks the event loop and calls sys.exit. What users read is in the
argparse texts below (`kvcm-sidecar --help`, `kvcm-sidecar COMMAND --help`).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import signal
import sys
import textwrap
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from sidecar import logs
from sidecar.config import Config, ConfigError, load, redacted

log = logging.getLogger("kvcm_sidecar")

DESCRIPTION = """\
Tell a KV Cache Manager (KVCM, tair-kvcache) what an LLM engine's prefix cache holds, so routers
can send each request to the replica that already has its prefix. Run one `kvcm-sidecar run` per
engine dp_rank, beside the engine (it reads the engine's shared-memory ring).

Configuration: defaults < --config TOML < KV_CACHE_EVENT_* environment < --set / flags.
Docs: README.md, docs/operations.md (every field, metric and state), docs/wire.md.
"""
EPILOG_RUN = """\
example:
  KV_CACHE_EVENT_MANAGER_ENDPOINT=http://kvcm-meta:6382 KV_CACHE_EVENT_INSTANCE_ID=llama-a \\
  KV_CACHE_EVENT_DP_RANK=0 KV_CACHE_EVENT_HOST_IP_PORT=10.0.0.5:8000 kvcm-sidecar run
Serves /metrics /healthz /readyz /status on http.metrics_addr (default 127.0.0.1:9400).
"""
EPILOG_REPLAY = """\
Each policy replays the same trace on the same engines (caches emptied in between):
  random, round_robin   ignore load and caches
  least_loaded          the engine with the shortest predicted queue wait
  kvcm                  asks KVCM getHostCacheState for the prompt's block keys; picks the lowest
                        predicted TTFT = queue wait + prefill of the tokens that host lacks
  oracle                the same score from every engine's true cache (the upper bound)
Engines are prefill-only: TTFT = queue wait + overhead_s + per_token_s * new
  + per_token_ctx_s * new * (cached + new / 2), new = uncached tokens (trace seconds).
A bad trace line (not JSON, a missing field, a timestamp earlier than the line before) exits 2
naming the line, before anything starts. See docs/operations.md "Replaying a trace".
"""


def _version() -> str:
    try:
        return version("kvcm-sidecar")
    except PackageNotFoundError:  # running from a source tree without an install
        return "0+unknown"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvcm-sidecar", description=DESCRIPTION, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--version", action="version", version=_version())
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, short, text, epilog in (
        (
            "run",
            "run the sidecar for one dp_rank",
            "Run the sidecar for one engine dp_rank: read the engine's shared-memory ring and "
            "report its cache to KVCM. Exit 0 stopped, 1 crashed, 2 bad config, 3 identity busy "
            "(another sidecar has this identity), 4 incompatible or corrupt ring.",
            EPILOG_RUN,
        ),
        (
            "check-config",
            "print the effective configuration or the config error",
            "Print the effective configuration (secrets redacted) as JSON, or the one-line "
            "error naming the source and field (exit 2). Touches no shm and no socket.",
            None,
        ),
    ):
        r = _sub(sub, name, short, text, epilog)
        r.add_argument("--config", type=Path, default=None, help="TOML file")
        r.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="SECTION.FIELD=VALUE",
            help="override one field (repeatable); highest precedence",
        )
        for flag, path in (
            ("--endpoint", "manager.endpoint"),
            ("--instance-id", "identity.instance_id"),
            ("--instance-group", "manager.instance_group"),
            ("--dp-rank", "identity.dp_rank"),
            ("--host-ip-port", "identity.host_ip_port"),
            ("--metrics-addr", "http.metrics_addr"),
            ("--publisher-type", "publisher_type"),
        ):
            r.add_argument(flag, dest=path, default=None, help=f"same as --set {path}=...")
    st = _sub(
        sub,
        "status",
        "summarise a sidecar (exit 0 healthy, 1 not)",
        "Summarise a running sidecar from its /status (state, lag, drops, resyncs); when it does "
        "not answer, read its ring header directly. Exit 0 if READY, 1 otherwise, 2 bad config.",
    )
    st.add_argument("--config", type=Path, default=None, help="TOML file")
    st.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override one field (repeatable), to find the sidecar's metrics address",
    )
    st.add_argument("--url", default=None, help="status URL (default: from http.metrics_addr)")
    st.add_argument("--json", action="store_true", help="print the JSON document")
    for flag, path in (
        ("--instance-id", "identity.instance_id"),
        ("--dp-rank", "identity.dp_rank"),
        ("--metrics-addr", "http.metrics_addr"),
    ):
        st.add_argument(flag, dest=path, default=None, help=f"same as --set {path}=...")
    st.set_defaults(publisher_type=None)
    d = _sub(
        sub,
        "demo",
        "the whole system on this machine, with a fault and a replay",
        "The whole system on this machine: a KVCM-compatible server, engine and sidecar "
        "processes, a sidecar killed and restarted mid-run, a per-rank check that KVCM matches "
        "every engine, then a short replay (round_robin vs kvcm). Exit 0 only if all converged.",
    )
    d.add_argument("--duration", type=float, default=12.0, help="seconds of workload")
    d.add_argument("--ranks", type=int, default=2, help="dp ranks (engine + sidecar each)")
    d.add_argument("--seed", type=int, default=1, help="workload seed")
    d.add_argument(
        "--source",
        choices=("ring", "zmq"),
        default="ring",
        help="ring: engine_hook engines (default); zmq: two vLLM-format ZMQ KV-event engines "
        "(int hashes, 32-byte digests; GPU and CPU) with a gap and a sidecar restart",
    )
    d.add_argument(
        "--cluster",
        action="store_true",
        help="a KVCM cluster: redis-server + 3 cluster-mode servers, the leader SIGKILLed "
        "mid-run (ring source; needs redis-server and the 'cluster' extra)",
    )
    _sub(
        sub,
        "include-dir",
        "print the directory of kvcm_ring.h (C/C++ producers)",
        "Print the directory of kvcm_ring.h, the header-only ring producer for C and C++ "
        "engines, so a build can use -I$(kvcm-sidecar include-dir).",
    )
    s = _sub(
        sub,
        "kvcm-server",
        "run a KVCM-compatible server (stand-in manager)",
        "Run a KVCM-compatible server for local runs and tests: the event-report API, the "
        "router queries and a /debug view (docs/kvcm_server.md). Prints 'kvcm-server meta "
        "listening on URL' once bound.",
    )
    s.add_argument("--host", default="127.0.0.1", help="address to bind")
    s.add_argument("--meta-port", type=int, default=6382, help="0 picks a free port")
    s.add_argument("--admin-port", type=int, default=None, help="default: share the meta port")
    s.add_argument(
        "--state-file",
        type=Path,
        default=None,
        help="persist instances and block metadata across restarts",
    )
    s.add_argument(
        "--bootstrap",
        action="store_true",
        help="create event-report storages and an instance group",
    )
    s.add_argument("--group", default="default", help="instance group created by --bootstrap")
    s.add_argument(
        "--max-body-bytes", type=int, default=64 * 1024 * 1024, help="larger requests get 413"
    )
    s.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=30000,
        help="a reporter without heartbeats this long is unavailable (its keys hidden)",
    )
    s.add_argument(
        "--cleanup-grace-ms",
        type=int,
        default=300000,
        help="then, after this long, unregistered and its metadata dropped",
    )
    s.add_argument(
        "--snapshot-min-interval-ms",
        type=int,
        default=30000,
        help="snapshots closer together are SNAPSHOT_RATE_LIMITED",
    )
    s.add_argument(
        "--meta-storage",
        default=None,
        metavar="redis://HOST:PORT/DB",
        help="cluster mode: storages, groups and instances in this Redis; nodes on one Redis "
        "elect one leader by lease, followers answer SERVER_NOT_LEADER",
    )
    s.add_argument("--node-id", default=None, help="this node's id (cluster mode: required)")
    s.add_argument(
        "--advertise-host",
        default=None,
        help="host that getClusterInfo names for this node (default: --host)",
    )
    s.add_argument(
        "--lease-ms",
        type=int,
        default=10000,
        help="cluster mode: the leader lease (renewed at a third)",
    )
    _replay_parser(sub)
    k = _sub(
        sub,
        "keys",
        "print the block keys of token ids (for router authors)",
        "Read token ids from stdin (a JSON array, or separated by whitespace) and print one key "
        "per full block, as KVCM stores it (signed int64): rolling is KVCM's own hash (token_ids "
        "queries, key_mode rolling); vllm_sha256_cbor is vLLM's --prefix-caching-hash-algo "
        "sha256_cbor with PYTHONHASHSEED=--seed; sglang_sha256 is SGLang's page hash. See "
        'docs/operations.md "Keys".',
    )
    k.add_argument(
        "--scheme",
        required=True,
        choices=("rolling", "vllm_sha256_cbor", "sglang_sha256"),
        help="which key: KVCM's rolling hash, vLLM sha256_cbor, SGLang's page hash",
    )
    k.add_argument("--block-size", type=int, required=True, help="tokens per block (page)")
    k.add_argument("--seed", default="0", help="vllm_sha256_cbor: the hash seed (default 0)")
    k.add_argument("--json", action="store_true", help="one JSON document (keys and digests)")
    return p


def _sub(sub: Any, name: str, short: str, text: str, epilog: str | None = None) -> Any:
    return sub.add_parser(
        name,
        help=short,
        description=textwrap.fill(text, 92),
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def _replay_parser(sub: Any) -> None:
    from sidecar.replay.router import POLICIES

    r = _sub(
        sub,
        "replay",
        "measure KVCM-aware routing on a request trace",
        "What KVCM-aware routing buys: replay a request trace through N prefill engines (real "
        "processes with the reference block cache and hook), one sidecar each, a KVCM-compatible "
        "server and a router, once per routing policy; print hit rate, prefill tokens, TTFT and "
        "requests per engine for each.",
        EPILOG_REPLAY,
    )
    r.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="Mooncake-format JSONL (timestamp ms, input_length, output_length, hash_ids); "
        "default: the built-in generator (shared system prompts, multi-turn, Zipf, Poisson)",
    )
    r.add_argument("--requests", type=int, default=None, help="replay only the first N requests")
    r.add_argument(
        "--speed", type=float, default=20.0, help="trace seconds per wall second (default 20)"
    )
    r.add_argument("--ranks", type=int, default=4, help="engines (each with its sidecar)")
    r.add_argument(
        "--capacity-blocks", type=int, default=4000, help="each engine's cache, in blocks"
    )
    r.add_argument("--block-tokens", type=int, default=512, help="tokens per block (Mooncake: 512)")
    r.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help=f"comma-separated, run in this order (default {','.join(POLICIES)})",
    )
    r.add_argument("--seed", type=int, default=1, help="generator and random-policy seed")
    r.add_argument("--rate", type=float, default=4.0, help="generated trace: arrivals per second")
    r.add_argument("--overhead-s", type=float, default=0.015, help="cost model: per prefill")
    r.add_argument("--per-token-s", type=float, default=4e-5, help="cost model: per new token")
    r.add_argument(
        "--per-token-ctx-s",
        type=float,
        default=2e-9,
        help="cost model: per new token x context length (attention)",
    )
    r.add_argument(
        "--source",
        choices=("ring", "zmq"),
        default="ring",
        help="ring: engine_hook engines (default); zmq: vLLM-format ZMQ KV-event engines, one "
        "table row per --key-mode x --engine-hash",
    )
    r.add_argument(
        "--engine-hash",
        default="random_seed",
        help="zmq: comma list of vllm_default (sha256 over pickle), sha256_cbor_seed0 (what "
        "FlexLB expects), random_seed (a seed per engine, as xxhash)",
    )
    r.add_argument(
        "--key-mode",
        default="rolling",
        help="zmq: comma list of the sidecars' key modes (engine, rolling, both)",
    )
    r.add_argument("--json", type=Path, default=None, help="write the results document here")
    r.add_argument(
        "--png",
        type=Path,
        default=None,
        help="TTFT CDF + hit-rate plot (needs the 'plot' extra; default: beside --json)",
    )


async def run_kvcm_server(args: argparse.Namespace) -> None:
    from aiohttp import web

    from sidecar.kvcm_server.app import KvcmServer

    # A big request decodes into ~10 objects per event; default gen0 thresholds would run the
    # collector hundreds of times per request in this dedicated process.
    gc.set_threshold(100_000, 50, 100)
    cluster = None
    if args.meta_storage is not None:
        from sidecar.kvcm_server.cluster import Cluster, Endpoint

        if not args.node_id or args.lease_ms < 30 or args.state_file is not None:
            sys.stderr.write(
                "kvcm-server: --meta-storage needs --node-id and --lease-ms >= 30, and no "
                "--state-file\n"
            )
            sys.exit(EXIT_CONFIG)
        try:
            cluster = Cluster(
                args.meta_storage,
                Endpoint(args.node_id, args.advertise_host or args.host, 0, 0),
                lease_s=args.lease_ms / 1000,
            )
        except ValueError as exc:
            sys.stderr.write(f"kvcm-server: {exc}\n")
            sys.exit(EXIT_CONFIG)
    server = KvcmServer(
        cluster=cluster,
        node_id=args.node_id or "kvcm-standin",
        state_file=args.state_file,
        bootstrap=args.bootstrap,
        group=args.group,
        max_body=args.max_body_bytes,
        event_report={
            "heartbeat_timeout_ms": args.heartbeat_timeout_ms,
            "cleanup_grace_ms": args.cleanup_grace_ms,
            "snapshot_min_interval_ms": args.snapshot_min_interval_ms,
        },
    )
    split = args.admin_port is not None
    runners = []
    apps = [("meta", server.app(admin=not split), args.meta_port)]
    if split:
        apps.append(("admin", server.app(meta=False), args.admin_port))
    for role, app, port in apps:
        # A request whose body never finishes arriving (a partitioned client) must not hold a
        # restart for aiohttp's default 60 s.
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=3.0)
        await runner.setup()
        site = web.TCPSite(runner, args.host, port)
        await site.start()
        runners.append(runner)
        bound = runner.addresses[0][1]
        # One line per listener on stdout: scripts and tests read the bound port from it.
        sys.stdout.write(f"kvcm-server {role} listening on http://{args.host}:{bound}\n")
        sys.stdout.flush()
        if cluster is not None and role == "meta":
            node = cluster.node
            cluster.node = Endpoint(node.node_id, node.host, 0, bound)
    # Everything alive now (modules, the app, a restored state file) lives as long as the
    # process: keep full collections from walking it (they paused requests ~50 ms).
    gc.freeze()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if cluster is None:
        await stop.wait()
    else:
        lease = asyncio.create_task(cluster.run(), name="lease")
        stopping = asyncio.create_task(stop.wait(), name="stop")
        await asyncio.wait({lease, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if lease.done():
            stopping.cancel()
            lease.result()  # the lease loop crashed: exit with its error (it never returns)
        log.info("kvcm cluster shutdown: stopping the lease loop")
        lease.cancel()
        # Bounded, as below: a Redis command that will not end must not hold the exit.
        await asyncio.wait({lease}, timeout=max(cluster.lease_s, 2.0))
    if cluster is not None:
        # Bounded: each Redis command may be retried on a timeout (redis-py's default Retry),
        # so a Redis slow to answer could hold a SIGTERM for tens of seconds (once seen under a
        # loaded test run: a node still running 20 s after it); past the budget the node exits
        # without them, as if killed (the lease runs out, the last periodic save stands).
        budget = max(cluster.lease_s, 2.0)
        log.info("kvcm cluster shutdown: saving blocks, releasing the lease budget_s=%.1f", budget)
        try:
            async with asyncio.timeout(budget):
                await server.save_blocks()  # what changed since the last save, while leader
                await cluster.release()  # before the listeners close: a follower takes over
        except TimeoutError:
            log.warning("kvcm cluster shutdown: save/release unfinished after %.1f s", budget)
    for runner in runners:
        await runner.cleanup()


EXIT_OK, EXIT_CRASH, EXIT_CONFIG, EXIT_BUSY, EXIT_RING = 0, 1, 2, 3, 4


def include_dir() -> Path:
    """Where the installed (or source-tree) engine_hook keeps kvcm_ring.h."""
    import engine_hook

    return Path(engine_hook.__file__).resolve().parent / "include"


def load_config(args: argparse.Namespace) -> Config:
    overrides: dict[str, str] = {}
    for item in args.set:
        path, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item}: expected SECTION.FIELD=VALUE")
        overrides[path.strip()] = value
    overrides.update(
        (key, value)
        for key, value in vars(args).items()
        if ("." in key or key == "publisher_type") and value is not None
    )
    return load(env=os.environ, toml_path=args.config, overrides=overrides)


async def run_sidecar(cfg: Config) -> int:
    from sidecar.daemon import Daemon

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = {"n": 0}

    def on_signal() -> None:
        signals["n"] += 1
        if signals["n"] > 1:
            log.warning("second signal: exiting at once")
            os._exit(EXIT_CRASH)
        log.info("signal received: shutting down grace_s=%s", cfg.shutdown.grace_s)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    # What is alive now (modules: aiohttp, prometheus, numpy) lives as long as the process; a
    # full collection walking it held the event loop ~40 ms, delaying every change in flight.
    gc.freeze()
    return await Daemon(cfg, stop).run()


def print_keys(args: argparse.Namespace) -> int:
    from sidecar import keys

    if args.scheme is None or args.block_size <= 0:
        sys.stderr.write("kvcm-sidecar keys: --scheme and --block-size > 0 are required\n")
        return EXIT_CONFIG
    try:
        tokens = keys.parse_tokens(sys.stdin.read())
    except ValueError as exc:
        sys.stderr.write(f"kvcm-sidecar keys: stdin is not token ids: {exc}\n")
        return EXIT_CONFIG
    got = keys.keys_for(args.scheme, tokens, args.block_size, args.seed)
    if args.json:
        doc = {
            "scheme": args.scheme,
            "block_size": args.block_size,
            "seed": args.seed if args.scheme == "vllm_sha256_cbor" else None,
            "tokens": len(tokens),
            "keys": [k for k, _ in got],
            "digests": [d for _, d in got] if args.scheme != "rolling" else None,
        }
        sys.stdout.write(json.dumps(doc) + "\n")
    else:
        sys.stdout.write("".join(f"{k}\n" for k, _ in got))
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        sys.exit(EXIT_CONFIG)
    if args.command == "include-dir":
        sys.stdout.write(f"{include_dir()}\n")
        sys.exit(EXIT_OK)
    import uvloop

    if args.command == "demo":
        logging.basicConfig(level=logging.WARNING)
        if args.source == "zmq":
            from sidecar import demo_zmq

            sys.exit(demo_zmq.run(args.duration, args.seed))
        from sidecar import demo

        sys.exit(demo.run(args.duration, args.ranks, args.seed, args.cluster))
    if args.command == "kvcm-server":
        logs.setup()
        uvloop.run(run_kvcm_server(args))
        sys.exit(EXIT_OK)
    if args.command == "replay":
        from sidecar.replay import cli as replay_cli

        logging.basicConfig(level=logging.WARNING)
        sys.exit(replay_cli.main(args))
    if args.command == "keys":
        sys.exit(print_keys(args))
    if args.command == "status":
        from sidecar import status as status_cmd

        sys.exit(status_cmd.main(args, os.environ))
    try:
        cfg = load_config(args)  # before any shm or socket is touched
    except ConfigError as exc:
        sys.stderr.write(f"kvcm-sidecar: config error: {exc}\n")
        sys.exit(EXIT_CONFIG)
    if args.command == "check-config":
        sys.stdout.write(json.dumps(redacted(cfg), indent=2, sort_keys=True) + "\n")
        sys.exit(EXIT_OK)
    logs.setup(cfg.log.level, cfg.log.format, cfg.log.repeat_interval_s)
    log.info("effective config %s", json.dumps(redacted(cfg), sort_keys=True))
    from sidecar.malloc import pin_mmap_threshold

    pin_mmap_threshold()
    from sidecar.daemon import IdentityBusy
    from sidecar.shm_ring.layout import LayoutError

    try:
        code = uvloop.run(run_sidecar(cfg))
    except IdentityBusy as exc:
        log.error("refusing to start: %s", exc)
        sys.exit(EXIT_BUSY)
    except LayoutError as exc:
        log.error("refusing the ring: %s", exc)
        sys.exit(EXIT_RING)
    except Exception:  # the CLI top level: a crashed loop exits non-zero so it is restarted
        log.exception("sidecar crashed")
        sys.exit(EXIT_CRASH)
    sys.exit(code)


if __name__ == "__main__":
    main()
