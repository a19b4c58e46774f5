"""The built wheel carries what C/C++ and typed engines need: kvcm_ring.h and engine_hook's
py.typed marker; `kvcm-sidecar include-dir` points at the header, installed or in the tree."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.cbuild import HEADER, INCLUDE, ROOT

pytestmark = pytest.mark.slow  # builds a wheel: ~4 s


def _include_dir(env: dict[str, str] | None = None, cwd: Path = ROOT) -> Path:
    res = subprocess.run(
        [sys.executable, "-m", "sidecar.cli", "include-dir"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd=cwd,
    )
    return Path(res.stdout.strip())


def test_packaging_include_dir_prints_the_header_directory() -> None:
    assert _include_dir() == INCLUDE and (INCLUDE / "kvcm_ring.h").is_file()


def test_packaging_wheel_carries_header_and_py_typed(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("kvcm_sidecar-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert "engine_hook/py.typed" in names
        assert z.read("engine_hook/include/kvcm_ring.h") == HEADER.read_bytes()
    # Installed from the wheel (no source tree on the path), include-dir finds the copy.
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "-q",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    found = _include_dir({"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}, cwd=tmp_path)
    assert found == target / "engine_hook" / "include"
    assert (found / "kvcm_ring.h").read_bytes() == HEADER.read_bytes()
