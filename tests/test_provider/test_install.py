"""A Windows gaming PC can install the provider: every runtime dependency has a wheel.

`pip download --platform win_amd64` evaluates environment markers against the machine it runs
on, not the target (a Linux-only dependency such as libp2p's `fastecdsa; sys_platform !=
"win32"` would be demanded and fail). So the dependency closure is resolved here the way a
Windows machine resolves it (markers evaluated for win32, Python 3.11), pinned to the versions
installed here (the project's constraints), and each pin is downloaded for win_amd64 / cp311
with `--no-deps`, preferring wheels. A package published only as source must be pure Python
(no C, C++, Cython or Rust sources), which builds on Windows without a compiler.
"""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

WINDOWS = {
    "sys_platform": "win32",
    "platform_system": "Windows",
    "os_name": "nt",
    "platform_machine": "AMD64",
    "python_version": "3.11",
    "python_full_version": "3.11.9",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def windows_pins() -> tuple[list[str], list[str]]:
    """(name==version pins of the installed closure, requirements not installed here)."""
    pins: dict[str, str] = {}
    unresolved: list[str] = []
    todo = [Requirement(r) for r in metadata.requires("fusionai") or []]
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate(WINDOWS):
            continue  # an extra (torch, dev, ...) or another platform's dependency
        name = _norm(req.name)
        if name in pins:
            continue
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            unresolved.append(str(req).split(";")[0])  # Windows-only: take the newest match
            continue
        pins[name] = version
        todo.extend(Requirement(r) for r in metadata.requires(req.name) or [])
    return sorted(f"{n}=={v}" for n, v in pins.items()), sorted(set(unresolved))


def test_the_closure_has_no_torch() -> None:
    pins, _ = windows_pins()
    names = {p.split("==")[0] for p in pins}
    assert "onnxruntime" in names and "libp2p" in names
    assert "torch" not in names and "fastecdsa" not in names  # Linux-only, as on Windows


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pip_downloads_windows_wheels_of_every_runtime_dependency(tmp_path: Path) -> None:
    pins, unresolved = windows_pins()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--prefer-binary",
            "--platform",
            "win_amd64",
            "--python-version",
            "3.11",
            "--implementation",
            "cp",
            "-d",
            str(tmp_path),
            *pins,
            *unresolved,
        ],
        capture_output=True,
        text=True,
        timeout=850,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    files = [p for p in tmp_path.iterdir() if p.is_file()]
    assert len(files) == len(pins) + len(unresolved)
    for path in files:
        if path.suffix == ".whl":
            tags = path.name[:-4].split("-")[-3:]  # python, abi, platform
            assert tags[2] in ("any", "win_amd64") and tags[1] in ("none", "abi3", "cp311"), path
        else:
            assert not _native_sources(path), f"{path.name} needs a compiler on Windows"


def _native_sources(sdist: Path) -> list[str]:
    import tarfile
    import zipfile

    if sdist.name.endswith(".zip"):
        names = zipfile.ZipFile(sdist).namelist()
    else:
        with tarfile.open(sdist) as tar:
            names = tar.getnames()
    return [n for n in names if n.endswith((".c", ".cc", ".cpp", ".pyx", ".rs"))]
