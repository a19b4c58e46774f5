"""`kvcm-sidecar` command line: the only place that reads the environment, configures logging,
installs signal handlers, picks the event loop and calls sys.exit.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib.metadata import version


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvcm-sidecar", description=__doc__)
    p.add_argument("--version", action="version", version=version("kvcm-sidecar"))
    p.add_subparsers(dest="command", metavar="COMMAND")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        sys.exit(2)


if __name__ == "__main__":
    main()
