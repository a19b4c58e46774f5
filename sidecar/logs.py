"""Logging setup for the CLI: stdout, text on a TTY and JSON lines otherwise, repeats limited.

Imports: stdlib only. WARNING records with the same logger and message template are emitted at
most once per interval; the next one that passes says how many were suppressed.
"""

from __future__ import annotations

import json
import logging
import sys
import time


class RateLimit(logging.Filter):
    def __init__(self, interval_s: float) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._last: dict[tuple[str, str], float] = {}
        self._suppressed: dict[tuple[str, str], int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = (record.name, str(record.msg))
        now = time.monotonic()
        if now - self._last.get(key, -1e18) < self.interval_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return False
        self._last[key] = now
        n = self._suppressed.pop(key, 0)
        if n:
            record.msg = f"{record.msg} suppressed=%d"
            record.args = (*(record.args or ()), n) if isinstance(record.args, tuple) else (n,)
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup(level: str = "INFO", fmt: str = "auto", repeat_interval_s: float = 60.0) -> None:
    handler = logging.StreamHandler(sys.stdout)
    use_json = fmt == "json" or (fmt == "auto" and not sys.stdout.isatty())
    handler.setFormatter(
        JsonFormatter()
        if use_json
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s")
    )
    handler.addFilter(RateLimit(repeat_interval_s))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
