"""`kvcm-sidecar` command line: the only place that reads the environment, configures logging,
installs signal handlers, picks the event loop and calls sys.exit.

Subcommands:
  kvcm-server   run the KVCM-compatible event-report server (stand-in manager)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

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
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for runner in runners:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stdout,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    if args.command is None:
        parser.print_help()
        sys.exit(2)
    import uvloop

    if args.command == "kvcm-server":
        uvloop.run(run_kvcm_server(args))
    sys.exit(0)


if __name__ == "__main__":
    main()
