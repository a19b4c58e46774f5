"""A child process of the demo or the replay: its stdout lines as a queue, stdin commands.

Imports: stdlib. Lines that parse as JSON objects arrive as dicts, others as text; a line with
`"stats": true` only updates `last` (progress displays read it). Every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import json
import signal
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Proc:
    name: str
    p: asyncio.subprocess.Process
    lines: asyncio.Queue[dict[str, Any] | str] = field(default_factory=asyncio.Queue)
    last: dict[str, Any] = field(default_factory=dict)

    async def pump(self) -> None:
        assert self.p.stdout is not None
        async for raw in self.p.stdout:
            text = raw.decode(errors="replace").strip()
            try:
                obj = json.loads(text)
            except ValueError:
                obj = text
            if isinstance(obj, dict) and obj.get("stats"):
                self.last = obj
            else:
                await self.lines.put(obj)

    async def expect(self, pred: Any, within_s: float = 30.0) -> Any:
        async with asyncio.timeout(within_s):
            while True:
                item = await self.lines.get()
                if pred(item):
                    return item

    async def send(self, text: str) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write((text + "\n").encode())
        await self.p.stdin.drain()

    async def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.p.returncode is None:
            self.p.send_signal(sig)
        return await asyncio.wait_for(self.p.wait(), 15)


async def spawn(
    name: str, *argv: str, env: dict[str, str] | None = None, tasks: list[asyncio.Task[None]]
) -> Proc:
    p = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
        limit=64 * 1024 * 1024,  # the engine's final line lists every published key
    )
    proc = Proc(name, p)
    tasks.append(asyncio.create_task(proc.pump()))  # cancelled in run()'s finally
    return proc
