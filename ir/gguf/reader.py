"""A GGUF model on disk: one file, its shards, or a folder holding one of either.

The `gguf` package parses headers (key-value metadata and the tensor table) and de-quantizes
blocks; tensor bytes are read here with `os.pread`, one tensor at a time, into memory that is
freed once the tensor is loaded. Reading them through the reader's memory map instead would keep
every page read mapped, so the process would grow towards the file's size.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ir.errors import IRError

SHARD = re.compile(r"\A(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf\Z")
CHUNK_ELEMENTS = 1 << 24  # de-quantize this many values at a time (64 MB of float32)


class GGUFError(IRError):
    """A GGUF file is unreadable, incomplete, or says something this version cannot use."""


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor's bytes are, and what they hold."""

    name: str
    path: Path
    offset: int
    n_bytes: int
    qtype: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order: (rows, ..., row length); ggml's ne reversed

    @property
    def type_name(self) -> str:
        return str(self.qtype.name)


def shard_files(path: Path) -> list[Path]:
    """The files of the model at `path`: `model.gguf`, `model-00001-of-00003.gguf` (its
    siblings are found), or a folder holding exactly one model (projector files ignored)."""
    if path.is_dir():
        found = sorted(p for p in path.glob("*.gguf") if not p.name.startswith("mmproj"))
        firsts = [p for p in found if (m := SHARD.match(p.name)) is None or m["no"] == "00001"]
        if len(firsts) != 1:
            names = ", ".join(p.name for p in found) or "none"
            raise GGUFError(
                f"{path} should hold one GGUF model (one file, or one set of shards); found: "
                f"{names}. Name the file to split"
            )
        path = firsts[0]
    if not path.is_file():
        raise GGUFError(f"{path}: no such file")
    match = SHARD.match(path.name)
    if match is None:
        return [path]
    count = int(match["count"])
    files = [
        path.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)
    ]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise GGUFError(
            f"{path.name} is one of {count} shards, but {', '.join(missing)} is missing"
        )
    return files


def _open(path: Path) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, OSError, UnicodeDecodeError) as exc:
        raise GGUFError(
            f"{path.name} is not a readable GGUF file (truncated or corrupt?): {exc}"
        ) from None


class GGUFModel:
    """The metadata of the first shard and the tensor table of all of them."""

    def __init__(self, path: Path) -> None:
        self.files = shard_files(path)
        self.meta: dict[str, Any] = {}
        self.tensors: dict[str, TensorRef] = {}
        for no, file in enumerate(self.files):
            reader = _open(file)
            fields = {name: field.contents() for name, field in reader.fields.items()}
            if no == 0:
                self.meta = fields
            if len(self.files) > 1 and (
                fields.get("split.no") != no or fields.get("split.count") != len(self.files)
            ):
                raise GGUFError(
                    f"{file.name} says it is shard {fields.get('split.no')} of "
                    f"{fields.get('split.count')}, not {no} of {len(self.files)}"
                )
            size = file.stat().st_size
            for t in reader.tensors:
                if t.name in self.tensors:
                    raise GGUFError(f"tensor {t.name} appears twice ({file.name})")
                if t.data_offset + t.n_bytes > size:
                    raise GGUFError(f"{file.name} is truncated: tensor {t.name} runs past its end")
                shape = tuple(int(n) for n in reversed(t.shape.tolist()))
                self.tensors[t.name] = TensorRef(
                    t.name, file, int(t.data_offset), int(t.n_bytes), t.tensor_type, shape
                )
            del reader
        if "general.architecture" not in self.meta:
            raise GGUFError(f"{self.files[0].name} names no architecture (general.architecture)")

    @property
    def arch(self) -> str:
        return str(self.meta["general.architecture"])

    def get(self, key: str, default: Any = None) -> Any:
        """`{arch}.{key}` (or a general key as is) from the metadata."""
        return self.meta.get(f"{self.arch}.{key}", self.meta.get(key, default))

    def read(self, name: str) -> np.ndarray:
        """One tensor, de-quantized to float32, in numpy order."""
        import gguf

        ref = self.tensors[name]
        with open(ref.path, "rb") as f:
            raw = os.pread(f.fileno(), ref.n_bytes, ref.offset)
        if len(raw) != ref.n_bytes:
            raise GGUFError(f"{ref.path.name} is truncated: tensor {name} runs past its end")
        data = np.frombuffer(raw, dtype=np.uint8)
        rows = int(np.prod(ref.shape[:-1])) if len(ref.shape) > 1 else 1
        try:
            if ref.qtype == gguf.GGMLQuantizationType.F32:
                return data.view(np.float32).reshape(ref.shape).copy()
            data = data.reshape(rows, -1)
            out = np.empty((rows, ref.shape[-1]), dtype=np.float32)
            step = max(1, CHUNK_ELEMENTS // ref.shape[-1])
            for start in range(0, rows, step):
                out[start : start + step] = gguf.quants.dequantize(
                    data[start : start + step], ref.qtype
                )
        except NotImplementedError:
            raise GGUFError(f"tensor {name} is {ref.type_name}, which cannot be read yet") from None
        return out.reshape(ref.shape)


@functools.cache
def readable(qtype: Any) -> bool:
    """Whether tensors of this type can be de-quantized (one block of zeros is tried)."""
    import gguf

    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True
