"""Compile the C engines under sidecar/testbed/c/ against kvcm_ring.h, once per source and flags.

Imports: stdlib. Binaries are cached by a hash of the sources and flags, so a test session or a
chaos run compiles each at most once. Without a compiler `compiler()` raises NoCompiler naming
what it looked for (tests/cbuild.py turns that into a skip; bench/hotpath_c.py reports it).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
INCLUDE = ROOT / "engine_hook" / "include"
HEADER = INCLUDE / "kvcm_ring.h"
C_DIR = Path(__file__).resolve().parent / "c"
CACHE = Path(tempfile.gettempdir()) / "kvcm-test-c"
C_FLAGS = ("-std=c99", "-Wall", "-Wextra", "-Werror", "-pedantic")
CXX_FLAGS = ("-std=c++17", "-Wall", "-Wextra", "-Werror")
# What stricter engine builds turn on: the header's bodies compile in the engine's own units.
STRICT = ("-Wshadow", "-Wconversion", "-Wsign-conversion", "-Wcast-qual")
STRICT_CXX = (*STRICT, "-Wpedantic", "-Wzero-as-null-pointer-constant")


def _names(cxx: bool) -> tuple[str, ...]:
    return ("g++", "c++", "clang++") if cxx else ("gcc", "cc", "clang")


def find_compiler(cxx: bool = False) -> str | None:
    for name in _names(cxx):
        path = shutil.which(name)
        if path:
            return path
    return None


class NoCompiler(Exception):
    """No C (or C++) compiler on PATH; the message names what was looked for."""


def compiler(cxx: bool = False) -> str:
    """The system C (or C++) compiler; NoCompiler if none exists."""
    path = find_compiler(cxx)
    if path is None:
        names = ", ".join(_names(cxx))
        raise NoCompiler(f"no {'C++' if cxx else 'C'} compiler found (looked for {names})")
    return path


def build(
    source: str | Path, *, cxx: bool = False, opt: str = "-O2", extra: tuple[str, ...] = ()
) -> Path:
    """Compile testbed/c/<source> or a path (as C99, or C++17 with cxx=True); the binary."""
    cc = compiler(cxx)
    src = C_DIR / source  # an absolute path stays itself
    flags = (*(CXX_FLAGS if cxx else C_FLAGS), opt, *extra)
    lang = ("-x", "c++") if cxx else ()
    digest = hashlib.sha1(usedforsecurity=False)
    for part in (src.read_bytes(), HEADER.read_bytes(), cc.encode(), " ".join(flags).encode()):
        digest.update(part)
    out = CACHE / f"{src.stem}-{'cxx' if cxx else 'c'}-{digest.hexdigest()[:12]}"
    if not out.exists():
        CACHE.mkdir(exist_ok=True)
        CACHE.chmod(0o755)  # a test runs a binary as another user (no-permission attach)
        tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")  # parallel sessions share CACHE
        argv = [cc, *lang, *flags, f"-I{INCLUDE}", str(src), "-o", str(tmp), "-pthread"]
        res = subprocess.run(argv, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            raise AssertionError(f"compile failed: {' '.join(argv)}\n{res.stderr}")
        tmp.chmod(0o755)
        tmp.rename(out)
    return out
