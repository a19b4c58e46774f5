"""Compile the C sources under tests/c/ against engine_hook/include/kvcm_ring.h, once per run.

Imports: stdlib (pytest only to skip). Binaries are cached by a hash of the sources and flags, so
a test session compiles each at most once; without a compiler a test skips with the reason
(bench/hotpath_c.py asks find_compiler() first and reports instead).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
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


def compiler(cxx: bool = False) -> str:
    """The system C (or C++) compiler, or skip the test saying none exists."""
    path = find_compiler(cxx)
    if path is None:
        import pytest  # only tests reach this line

        names = ", ".join(_names(cxx))
        pytest.skip(f"no {'C++' if cxx else 'C'} compiler found (looked for {names})")
    return path


def build(
    source: str | Path, *, cxx: bool = False, opt: str = "-O2", extra: tuple[str, ...] = ()
) -> Path:
    """Compile tests/c/<source> or a path (as C99, or C++17 with cxx=True); returns the binary."""
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
