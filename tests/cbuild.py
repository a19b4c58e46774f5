"""The testbed's C engine builds (sidecar/testbed/cbuild.py) for tests: no compiler is a skip.

Imports: pytest, sidecar.testbed.cbuild.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.testbed import cbuild as _cbuild
from sidecar.testbed.cbuild import (
    C_DIR,
    C_FLAGS,
    CXX_FLAGS,
    HEADER,
    INCLUDE,
    ROOT,
    STRICT,
    STRICT_CXX,
    find_compiler,
)

__all__ = ["CXX_FLAGS", "C_DIR", "C_FLAGS", "HEADER", "INCLUDE", "ROOT", "STRICT", "STRICT_CXX"]
__all__ += ["build", "compiler"]
__all__ += ["find_compiler"]


def compiler(cxx: bool = False) -> str:
    try:
        return _cbuild.compiler(cxx)
    except _cbuild.NoCompiler as exc:
        pytest.skip(str(exc))


def build(
    source: str | Path, *, cxx: bool = False, opt: str = "-O2", extra: tuple[str, ...] = ()
) -> Path:
    compiler(cxx)  # skip, naming what was looked for, before the build would raise
    return _cbuild.build(source, cxx=cxx, opt=opt, extra=extra)
