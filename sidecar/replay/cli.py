"""`kvcm-sidecar replay` arguments -> Settings + trace -> the run, the table, JSON and PNG.

Imports: stdlib, sidecar.replay. Everything is validated (trace lines included) before any
process starts; a bad value or line prints one line and returns exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

from sidecar.replay.report import plot
from sidecar.replay.router import CostModel
from sidecar.replay.run import Settings, keys_table, replay
from sidecar.replay.stack import StackError
from sidecar.replay.trace import Request, TraceError, Workload, generated, read

EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2


def load(args: argparse.Namespace) -> tuple[list[Request], Settings]:
    """Settings and requests from the arguments; ValueError (TraceError too) names the problem."""
    cost = CostModel(args.overhead_s, args.per_token_s, args.per_token_ctx_s, args.block_tokens)
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    cfg = Settings(
        args.ranks,
        args.capacity_blocks,
        args.speed,
        policies,
        args.seed,
        cost,
        source=args.source,
        engine_hash=args.engine_hash.split(",")[0],
        key_mode=args.key_mode.split(",")[0],
    )
    for km in args.key_mode.split(","):
        for eh in args.engine_hash.split(","):
            replace(cfg, key_mode=km.strip(), engine_hash=eh.strip())  # validates every row
    if args.requests is not None and args.requests < 1:
        raise ValueError("--requests must be >= 1")
    if args.trace is not None:
        requests = read(args.trace, args.block_tokens)
    else:
        if not args.rate > 0:
            raise ValueError("--rate must be > 0")
        w = Workload(requests=args.requests or Workload.requests, rate_per_s=args.rate)
        requests = generated(w, args.seed, args.block_tokens)
    if args.requests is not None:
        requests = requests[: args.requests]
    return requests, cfg


def main(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    try:
        requests, cfg = load(args)
    except (TraceError, ValueError) as exc:
        sys.stderr.write(f"kvcm-sidecar replay: {exc}\n")
        return EXIT_CONFIG
    source = str(args.trace) if args.trace else f"generated trace (seed {args.seed})"
    out.write(f"kvcm-sidecar replay: {source}, policies {','.join(cfg.policies)}\n")
    if cfg.source == "zmq":
        return _zmq(args, requests, cfg, source, out)
    try:
        doc, runs = replay(requests, cfg, out=out)
    except (StackError, OSError) as exc:  # a child died or stopped answering: no report
        sys.stderr.write(f"kvcm-sidecar replay: {exc}\n")
        return EXIT_FAILED
    doc["trace"] = source
    png: Path | None = args.png or (args.json.with_suffix(".png") if args.json else None)
    if png is not None:
        if plot(runs, doc["theoretical_hit_rate"], png):
            doc["png"] = str(png)
            out.write(f"  plot: {png}\n")
        else:
            out.write(
                "  plot: skipped (install the plot extra: pip install 'kvcm-sidecar[plot]')\n"
            )
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        out.write(f"  results: {args.json}\n")
    ok = all(r.served_once() and r.consistent for r in runs)
    if not ok:
        out.write("  FAILED: a request was not served exactly once or KVCM did not match\n")
    return EXIT_OK if ok else EXIT_FAILED


def _zmq(
    args: argparse.Namespace, requests: list[Request], cfg: Settings, source: str, out: TextIO
) -> int:
    """One replay per (key mode, engine hash), then one table row each."""
    docs: list[dict[str, Any]] = []
    ok = True
    for km in args.key_mode.split(","):
        for eh in args.engine_hash.split(","):
            row = replace(cfg, key_mode=km.strip(), engine_hash=eh.strip())
            out.write(f"  --source zmq, key mode {row.key_mode}, engine hash {row.engine_hash}\n")
            try:
                doc, runs = replay(requests, row, out=out)
            except (StackError, OSError) as exc:
                sys.stderr.write(f"kvcm-sidecar replay: {exc}\n")
                return EXIT_FAILED
            doc["trace"] = source
            docs.append(doc)
            ok = ok and all(r.served_once() and r.consistent for r in runs)
    out.write(keys_table(docs) + "\n")
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": docs}, indent=2) + "\n")
        out.write(f"  results: {args.json}\n")
    if not ok:
        out.write("  FAILED: a request was not served exactly once or KVCM did not match\n")
    return EXIT_OK if ok else EXIT_FAILED
