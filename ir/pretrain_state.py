"""A pre-training replica's whole state as named arrays, and trained weights as a package.

`export_state` / `load_state`: what a replica joining a run mid-way takes from a peer, so that
it continues exactly as the peer would: the weights, AdamW's moments and step, DiLoCo's outer
weights and momentum, and the compressor's shared warm start (Power-SGD's and ACP-SGD's P and
Q). The compressor's error feedback is not taken: it is the residual of the peer's own
gradients, and the joiner starts with none. Names are "<part>/<name>": w (weights), m and v
(AdamW's first and second moments), o and u (DiLoCo's outer weights and momentum), c (the
compressor), and "step".

`save_package`: the trained weights as a new package, the source package's stages with each
trained initializer replaced, and its tokenizer.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ir.errors import PretrainError
from ir.manifest import ModelManifest

if TYPE_CHECKING:
    from ir.pretrain import DataParallel

Array = np.ndarray[Any, Any]
LOCAL_ONLY = "error."  # compressor state that is each replica's own


def export_state(dp: DataParallel, *, weights_only: bool = False) -> dict[str, Array]:
    """The replica's committed state (none may be prepared), by name."""
    if dp.pending is not None:
        raise PretrainError("a step is prepared: commit or abort it before reading the state")
    r = dp.replica
    out = {f"w/{n}": w for n, w in r.weights().items()}
    if weights_only:
        return out
    out["step"] = np.array([r.step], dtype=np.int64)
    for n, p in r.params.items():
        st = r.optimizer.state.get(p)
        if st:
            out[f"m/{n}"] = st["exp_avg"].detach().numpy().copy()
            out[f"v/{n}"] = st["exp_avg_sq"].detach().numpy().copy()
    for n, w in (dp.outer or {}).items():
        out[f"o/{n}"] = w.copy()
    for n, w in dp.momentum.items():
        out[f"u/{n}"] = w.copy()
    for k, v in dp.compressor.state().items():
        if not k.startswith(LOCAL_ONLY):
            out[f"c/{k}"] = np.array(v, copy=True)
    return out


def load_state(dp: DataParallel, state: Mapping[str, Array]) -> None:
    """Take a peer's `export_state` (every array checked against this replica's shapes)."""
    import torch

    r = dp.replica
    shapes = r.shapes()

    def part(prefix: str, required: bool) -> dict[str, Array]:
        got = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        if not got and not required:
            return {}
        for n, shape in shapes.items():
            v = got.get(n)
            if v is None or tuple(v.shape) != shape or v.dtype != np.float32:
                raise PretrainError(f"the state has no float32 {prefix}{n} of shape {shape}")
        return got

    weights = part("w/", True)
    m, v = part("m/", False), part("v/", False)
    step = state.get("step")
    if step is None or step.shape != (1,) or int(step[0]) < 0:
        raise PretrainError("the state has no step")
    if dp.outer_every:
        outer = part("o/", True)
        momentum = part("u/", False)
    comp = {k[2:]: a for k, a in state.items() if k.startswith("c/")}
    for k, a in dp.compressor.state().items():  # the joiner's own error starts at zero
        if k.startswith(LOCAL_ONLY):
            comp[k] = np.zeros_like(a)
    dp.compressor.load_state(comp)  # (checks its own arrays)
    r.set_weights(weights)
    r.step = int(step[0])
    r.optimizer.state.clear()
    if m:
        for n, p in r.params.items():
            r.optimizer.state[p] = {
                "step": torch.tensor(float(r.step)),
                "exp_avg": torch.from_numpy(np.array(m[n])),
                "exp_avg_sq": torch.from_numpy(np.array(v[n])),
            }
    if dp.outer_every:
        dp.outer = {n: np.array(a) for n, a in outer.items()}
        dp.momentum = {n: np.array(a) for n, a in momentum.items()}
    dp.pending = None


def save_package(
    directory: Path, manifest: ModelManifest, weights: Mapping[str, Array], out: Path, name: str
) -> Path:
    """A new package at `out` named `name`: the stages of the package at `directory` with
    each initializer named in `weights` ("<stage index>:<initializer>") replaced, ready to
    serve. Written beside and moved into place: no half-written package."""
    import shutil
    import tempfile

    import msgspec
    import onnx
    from onnx import numpy_helper

    from files.atomic import move_atomic
    from files.digest import sha256_file
    from ir.package import write_manifest

    out.mkdir(parents=True, exist_ok=True)
    infos = []
    used: set[str] = set()
    written: list[tuple[Path, str]] = []
    with tempfile.TemporaryDirectory(dir=out, prefix=".save-") as tmp:
        for info in sorted(manifest.stages, key=lambda s: s.index):
            model = onnx.load(str(directory / info.file))
            for init in model.graph.initializer:
                key = f"{info.index}:{init.name}"
                if key in weights:
                    new = np.asarray(weights[key])
                    if tuple(new.shape) != tuple(init.dims):
                        raise PretrainError(f"weight {key}: shape {new.shape}, not {init.dims}")
                    init.CopyFrom(numpy_helper.from_array(new, init.name))
                    used.add(key)
            path = Path(tmp) / f"stage{info.index}.onnx"
            onnx.save(model, str(path))
            sha, size = sha256_file(path), path.stat().st_size
            written.append((path, sha))
            infos.append(
                msgspec.structs.replace(info, file=f"{sha}.onnx", sha256=sha, size_bytes=size)
            )
        unknown = sorted(set(weights) - used)
        if unknown:
            raise PretrainError(f"weights the package does not have: {', '.join(unknown[:5])}")
        for path, sha in written:
            move_atomic(path, out / f"{sha}.onnx")
    if manifest.tokenizer:
        shutil.copyfile(directory / manifest.tokenizer, out / manifest.tokenizer)
    write_manifest(msgspec.structs.replace(manifest, name=name, stages=infos), out)
    return out
