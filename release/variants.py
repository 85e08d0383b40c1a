"""One distribution per onnxruntime build, made from this source tree: each installs exactly
one build, so no two overwrite each other's files (they share the `onnxruntime` module).

    fusionai           onnxruntime (CPU; CoreML on macOS): pyproject.toml as it is
    fusionai-cuda      onnxruntime-gpu (CUDA) on Linux and Windows; the CPU build on macOS,
                       where there is no CUDA build
    fusionai-directml  onnxruntime-directml on Windows; the CPU build elsewhere

    python release/variants.py pyproject cuda            # that variant's pyproject.toml
    python release/variants.py wheel cuda --out dist/    # build its wheel

A variant differs from `fusionai` in its name and the onnxruntime line only; the code and
every other dependency are the same (`tests/test_provider/test_install.py` resolves each for
Linux x86-64, macOS arm64 and Windows x86-64 and counts the onnxruntime builds).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE_LINE = '    "onnxruntime>=1.18",'  # the CPU build, in pyproject.toml's dependencies
RUNTIMES = ("onnxruntime", "onnxruntime-gpu", "onnxruntime-directml")
VARIANTS: dict[str, list[str]] = {
    "cpu": ["onnxruntime>=1.18"],
    "cuda": [
        "onnxruntime-gpu>=1.18; sys_platform != 'darwin'",
        "onnxruntime>=1.18; sys_platform == 'darwin'",
    ],
    "directml": [
        "onnxruntime-directml>=1.18; sys_platform == 'win32'",
        "onnxruntime>=1.18; sys_platform != 'win32'",
    ],
}


def distribution(variant: str) -> str:
    return "fusionai" if variant == "cpu" else f"fusionai-{variant}"


def pyproject(variant: str, source: Path = ROOT / "pyproject.toml") -> str:
    """The variant's pyproject.toml: the project's own, renamed, with its onnxruntime line."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; one of {', '.join(VARIANTS)}")
    text = source.read_text()
    if text.count(BASE_LINE) != 1 or text.count('name = "fusionai"') != 1:
        raise ValueError(f"{source} no longer has one {BASE_LINE.strip()!r} line and name")
    if variant == "cpu":
        return text
    lines = "\n".join(f'    "{d}",' for d in VARIANTS[variant])
    text = text.replace(BASE_LINE, lines)
    return text.replace('name = "fusionai"', f'name = "{distribution(variant)}"')


def wheel(variant: str, out: Path) -> Path:
    """Build the variant's wheel into `out` (a copy of the tree with its pyproject.toml)."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "src"
        ignore = shutil.ignore_patterns(".*", "build", "dist", "*.egg-info", "__pycache__")
        shutil.copytree(ROOT, tree, ignore=ignore)
        (tree / "pyproject.toml").write_text(pyproject(variant))
        before = set(out.glob("*.whl"))
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(tree)],
            check=True,
        )
    (made,) = set(out.glob("*.whl")) - before
    return made


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["pyproject", "wheel"])
    parser.add_argument("variant", choices=list(VARIANTS))
    parser.add_argument("--out", type=Path, default=ROOT / "dist")
    args = parser.parse_args()
    if args.what == "pyproject":
        sys.stdout.write(pyproject(args.variant))
    else:
        print(wheel(args.variant, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
