"""A gaming PC can install the provider: without a compiler, with one onnxruntime build.

Windows wheels (below, slow): `pip download --platform win_amd64` evaluates environment
markers against the machine it runs on, not the target (a Linux-only dependency such as
libp2p's `fastecdsa; sys_platform != "win32"` would be demanded and fail). So the dependency
closure is resolved here the way a Windows machine resolves it (markers evaluated for win32,
Python 3.11), pinned to the versions installed here (the project's constraints), and each pin
is downloaded for win_amd64 / cp311 with `--no-deps`, preferring wheels. A package published
only as source must be pure Python (no C, C++, Cython or Rust sources), which builds on
Windows without a compiler.

All three platforms (further below): uv resolves each distribution (fusionai, fusionai-cuda,
fusionai-directml: `release/variants.py`) for Linux x86-64, macOS arm64 and Windows x86-64
with their markers, wheels only, with `no-compiler.txt`'s override of libp2p's fastecdsa pin;
and this machine installs it so and runs the p2p layer.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path
from typing import Any

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
    wanted = [*pins, *unresolved]
    # pip reads each package's index page on one core: a few pip processes share the list
    parts = max(1, min(4, os.cpu_count() or 1))

    def download(names: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--prefer-binary",
             "--platform", "win_amd64", "--python-version", "3.11", "--implementation", "cp",
             "-d", str(tmp_path), *names],
            capture_output=True, text=True, timeout=850,
        )  # fmt: skip

    with ThreadPoolExecutor(parts) as pool:
        for result in pool.map(download, [wanted[i::parts] for i in range(parts)]):
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


# ---- no compiler, one onnxruntime build per distribution ------------------------------------

ROOT = Path(__file__).resolve().parents[2]
PLATFORMS = {  # uv's names for the three platforms a provider installs on
    "linux-x86_64": "x86_64-manylinux_2_28",
    "macos-arm64": "aarch64-apple-darwin",
    "windows-x86_64": "x86_64-pc-windows-msvc",
}
# Published as source only, and pure Python (checked below): they build without a compiler.
PURE_SDISTS = ("varint", "python-baseconv")
RUNTIMES = {"onnxruntime", "onnxruntime-gpu", "onnxruntime-directml"}
BROKER = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


def test_provider_start_refuses_two_onnxruntime_builds(tmp_path: Path) -> None:
    """A second build's distribution metadata next to the CPU one (as `pip install
    onnxruntime-gpu` would leave it): start refuses before doing anything, naming both."""
    site = tmp_path / "site"
    info = site / "onnxruntime_gpu-1.23.2.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: onnxruntime-gpu\nVersion: 1.23.2\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "cli.main", "provider", "start", "--broker", BROKER,
         "--data-dir", str(tmp_path / "data")],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(site)},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "several onnxruntime builds are installed (onnxruntime, onnxruntime-gpu)" in done.stderr
    assert "pip uninstall -y onnxruntime onnxruntime-gpu" in done.stderr
    assert not (tmp_path / "data").exists()  # refused before anything was made


async def test_fastecdsa_is_imported_but_never_called_on_our_paths() -> None:
    """Why overriding libp2p's fastecdsa pin (no-compiler.txt) is sound: libp2p imports it
    for secio and P-256 keys, which our hosts neither offer nor accept; a whole Noise
    handshake and requests run without calling into it."""
    import threading

    import p2p._libp2p  # noqa: F401  (imports libp2p, and so fastecdsa, before we watch)
    from p2p import Host
    from p2p.testing import ECHO_COMPUTE, ECHO_CONTROL, LOCAL, Echo, serve_test_protocols

    if sys.platform == "win32":
        pytest.skip("libp2p uses coincurve, not fastecdsa, on Windows")
    assert "fastecdsa" in sys.modules
    calls: list[str] = []

    def watch(frame: Any, what: str, arg: Any) -> None:
        where = frame.f_code.co_filename
        module = getattr(arg, "__module__", None) or "" if what == "c_call" else ""
        if "fastecdsa" in where or module.startswith("fastecdsa"):
            calls.append(f"{what} {where}:{frame.f_code.co_name} {module}")

    threading.setprofile(watch)
    sys.setprofile(watch)
    try:
        async with Host(LOCAL) as server, Host(LOCAL) as client:
            serve_test_protocols(server)
            peer = await client.connect(server.addrs[0])
            assert (await client.request(peer, ECHO_CONTROL, Echo(n=1))).n == 2
            assert (await client.request(peer, ECHO_COMPUTE, Echo(n=1))).n == 3
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    assert not calls, calls[:5]


def _uv() -> list[str]:
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not installed (it is in the dev extra: pip install uv)")
    return [uv]


def _compile(pyproject: Path, platform: str, *extra: str) -> subprocess.CompletedProcess[str]:
    binary = [w for name in PURE_SDISTS for w in ("--no-binary", name)]
    return subprocess.run(
        [*_uv(), "pip", "compile", str(pyproject), "--python-platform", PLATFORMS[platform],
         "--python-version", "3.11", "--only-binary", ":all:", *binary, "--no-header",
         "--no-annotate", "-q", *extra],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip


def _pins(out: str) -> dict[str, str]:
    pins = dict(line.split("==", 1) for line in out.splitlines() if "==" in line)
    return {_norm(n): v.split(";")[0].strip() for n, v in pins.items()}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_each_distribution_resolves_to_wheels_with_one_onnxruntime_build(tmp_path: Path) -> None:
    """fusionai, fusionai-cuda and fusionai-directml, each resolved for Linux x86-64, macOS
    arm64 and Windows x86-64 by a resolver that evaluates those platforms' markers, wheels
    only (two pure-Python source packages aside): exactly one onnxruntime build each. Off
    Windows, libp2p's fastecdsa pin has no wheel; with no-compiler.txt's override it does."""
    sys.path.insert(0, str(ROOT / "release"))
    try:
        import variants
    finally:
        sys.path.remove(str(ROOT / "release"))
    overrides = ["--overrides", str(ROOT / "no-compiler.txt")]
    jobs: dict[tuple[str, str], list[Any]] = {
        ("pinned", "linux-x86_64"): [ROOT / "pyproject.toml", "linux-x86_64"],
    }
    for variant in variants.VARIANTS:
        project = tmp_path / variant / "pyproject.toml"
        project.parent.mkdir()
        project.write_text(variants.pyproject(variant))
        for platform in PLATFORMS:
            jobs[variant, platform] = [project, platform, *overrides]
    with ThreadPoolExecutor(len(jobs)) as pool:  # each waits on the index, not the CPU
        answers = dict(zip(jobs, pool.map(lambda j: _compile(*j), jobs.values()), strict=True))
    pinned = answers.pop(("pinned", "linux-x86_64"))
    assert pinned.returncode != 0 and "fastecdsa" in pinned.stderr  # the pin, as documented
    seen: dict[tuple[str, str], set[str]] = {}
    for (variant, platform), done in answers.items():
        assert done.returncode == 0, (variant, platform, done.stderr[-3000:])
        pins = _pins(done.stdout)
        assert "libp2p" in pins and "torch" not in pins, (variant, platform)
        seen[variant, platform] = set(pins) & RUNTIMES
        if platform == "windows-x86_64":
            assert "fastecdsa" not in pins  # libp2p needs none there
        else:
            assert pins["fastecdsa"] == "4.0.0"
    expected = {"cpu": {p: "onnxruntime" for p in PLATFORMS},
                "cuda": {"linux-x86_64": "onnxruntime-gpu", "macos-arm64": "onnxruntime",
                         "windows-x86_64": "onnxruntime-gpu"},
                "directml": {"linux-x86_64": "onnxruntime", "macos-arm64": "onnxruntime",
                             "windows-x86_64": "onnxruntime-directml"}}  # fmt: skip
    assert seen == {(v, p): {rt} for v, by in expected.items() for p, rt in by.items()}
    # the source-only packages let through are pure Python: no compiler builds them either
    versions = _pins(answers["cpu", "linux-x86_64"].stdout)
    sdists = tmp_path / "sdists"
    got = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
         "-d", str(sdists), *(f"{n}=={versions[n]}" for n in PURE_SDISTS)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert got.returncode == 0, got.stderr[-2000:]
    for sdist in sdists.iterdir():
        assert not _native_sources(sdist), f"{sdist.name} needs a compiler"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_linux_install_without_a_compiler_runs_the_p2p_layer(tmp_path: Path) -> None:
    """This machine: the project installed into a fresh environment by uv, wheels only with
    no-compiler.txt (fastecdsa 4.0.0), then two peers of it complete a Noise handshake."""
    if not sys.platform.startswith("linux"):
        pytest.skip("installs for this machine's platform, resolved above for the others")
    venv = tmp_path / "venv"
    subprocess.run([*_uv(), "venv", "-q", "--python", sys.executable, str(venv)], check=True,
                   timeout=120)  # fmt: skip
    python = venv / "bin" / "python"
    binary = [w for name in (*PURE_SDISTS, "fusionai") for w in ("--no-binary", name)]
    done = subprocess.run(
        [*_uv(), "pip", "install", "-q", "--python", str(python), "--only-binary", ":all:",
         *binary, "--overrides", str(ROOT / "no-compiler.txt"), str(ROOT)],
        capture_output=True, text=True, timeout=500,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    check = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('fastecdsa'))"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert check.stdout.strip() == "4.0.0", check.stderr
    fusionai = [str(venv / "bin" / "fusionai"), "p2p"]
    env = {**os.environ, "FUSIONAI_DATA_DIR": str(tmp_path / "a")}
    server = subprocess.Popen(
        [*fusionai, "serve", "--listen", "/ip4/127.0.0.1/tcp/0", "--json"],
        stdout=subprocess.PIPE, text=True, cwd=tmp_path, env=env,
    )  # fmt: skip
    try:
        assert server.stdout is not None
        addr = json.loads(server.stdout.readline())["addrs"][0]
        ping = subprocess.run(
            [*fusionai, "ping", addr, "--count", "3", "--json"],
            capture_output=True, text=True, timeout=60, cwd=tmp_path,
            env={**os.environ, "FUSIONAI_DATA_DIR": str(tmp_path / "b")},
        )  # fmt: skip
    finally:
        server.kill()
        server.wait()
    assert ping.returncode == 0, ping.stderr[-2000:]
    assert json.loads(ping.stdout)["pings"] == 3
