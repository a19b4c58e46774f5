"""`kvcm-sidecar` command line: the only place that reads the environment, configures logging,
installs signal handlers, picks the event loop and calls sys.exit.

Subcommands:
  run           run the sidecar for one dp_rank (exit 0 stopped, 1 crashed, 2 bad config,
                3 identity busy, 4 incompatible or corrupt ring)
  check-config  print the effective configuration (secrets redacted) or the config error
  status        summarise a running sidecar (or the ring, if it is down); exit 0 if healthy
  demo          the whole system on this machine, with a fault and a consistency check
                (--source zmq: vLLM-format ZMQ engines instead of the ring)
  kvcm-server   run the KVCM-compatible event-report server (stand-in manager)
  include-dir   print the directory of kvcm_ring.h, the C/C++ producer header
                (build with -I$(kvcm-sidecar include-dir))
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
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from sidecar import logs
from sidecar.config import Config, ConfigError, load, redacted

log = logging.getLogger("kvcm_sidecar")


def _version() -> str:
    try:
        return version("kvcm-sidecar")
    except PackageNotFoundError:  # running from a source tree without an install
        return "0+unknown"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvcm-sidecar", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--version", action="version", version=_version())
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, text in (
        ("run", "run the sidecar for one dp_rank"),
        ("check-config", "print the effective config or the config error"),
    ):
        r = sub.add_parser(name, help=text)
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
    st = sub.add_parser("status", help="summarise a sidecar's state (exit 0 healthy, 1 not)")
    st.add_argument("--config", type=Path, default=None, help="TOML file")
    st.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    st.add_argument("--url", default=None, help="status URL (default: from http.metrics_addr)")
    st.add_argument("--json", action="store_true", help="print the JSON document")
    for flag, path in (
        ("--instance-id", "identity.instance_id"),
        ("--dp-rank", "identity.dp_rank"),
        ("--metrics-addr", "http.metrics_addr"),
    ):
        st.add_argument(flag, dest=path, default=None)
    st.set_defaults(publisher_type=None)
    d = sub.add_parser("demo", help="run engines + sidecars + a KVCM-compatible server")
    d.add_argument("--duration", type=float, default=20.0, help="seconds of workload")
    d.add_argument("--ranks", type=int, default=2, help="dp ranks (engine + sidecar each)")
    d.add_argument("--seed", type=int, default=1)
    d.add_argument(
        "--source",
        choices=("ring", "zmq"),
        default="ring",
        help="ring: engine_hook engines; zmq: vLLM-format ZMQ KV-event engines (2 ranks)",
    )
    sub.add_parser("include-dir", help="print the directory of kvcm_ring.h (C/C++ producers)")
    s = sub.add_parser("kvcm-server", help="run the KVCM-compatible event-report server")
    s.add_argument("--host", default="127.0.0.1")
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
    s.add_argument("--max-body-bytes", type=int, default=64 * 1024 * 1024)
    s.add_argument("--heartbeat-timeout-ms", type=int, default=30000)
    s.add_argument("--cleanup-grace-ms", type=int, default=300000)
    s.add_argument("--snapshot-min-interval-ms", type=int, default=30000)
    return p


async def run_kvcm_server(args: argparse.Namespace) -> None:
    from aiohttp import web

    from sidecar.kvcm_server.app import KvcmServer

    # A big request decodes into ~10 objects per event; default gen0 thresholds would run the
    # collector hundreds of times per request in this dedicated process.
    gc.set_threshold(100_000, 50, 100)
    server = KvcmServer(
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
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, args.host, port)
        await site.start()
        runners.append(runner)
        bound = runner.addresses[0][1]
        # One line per listener on stdout: scripts and tests read the bound port from it.
        sys.stdout.write(f"kvcm-server {role} listening on http://{args.host}:{bound}\n")
        sys.stdout.flush()
    # Everything alive now (modules, the app, a restored state file) lives as long as the
    # process: keep full collections from walking it (they paused requests ~50 ms).
    gc.freeze()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
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

        sys.exit(demo.run(args.duration, args.ranks, args.seed))
    if args.command == "kvcm-server":
        logs.setup()
        uvloop.run(run_kvcm_server(args))
        sys.exit(EXIT_OK)
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
