"""The executor interface and the input checks every executor shares."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from ir.errors import ExecutorError
from ir.manifest import TensorInfo


class Executor(Protocol):
    """Runs one stage. Thread-safe `run`; inputs and outputs keyed by graph tensor names."""

    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    name: str  # e.g. "onnxruntime:CPUExecutionProvider", "torch:cpu"

    def run(self, feeds: Mapping[str, np.ndarray[Any, Any]]) -> dict[str, np.ndarray[Any, Any]]: ...


_DTYPE_NAMES: dict[Any, str] = {}  # dtype -> its name ("float32"): str() of one is slow


def _dtype_name(dtype: Any) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = str(dtype).replace("torch.", "")
        if len(_DTYPE_NAMES) < 64:
            _DTYPE_NAMES[dtype] = name
    return name


def check_feeds(inputs: list[TensorInfo], feeds: Mapping[str, Any]) -> None:
    """Clear errors for missing, unexpected, mistyped or wrongly-ranked inputs."""
    expected = {i.name: i for i in inputs}
    missing = [n for n in expected if n not in feeds]
    if missing:
        raise ExecutorError(f"missing inputs {missing}; the stage takes {list(expected)}")
    extra = [n for n in feeds if n not in expected]
    if extra:
        raise ExecutorError(f"unexpected inputs {extra}; the stage takes {list(expected)}")
    for name, info in expected.items():
        value = feeds[name]
        dtype = _dtype_name(getattr(value, "dtype", ""))
        if dtype != info.dtype:
            raise ExecutorError(f"input {name!r} must be {info.dtype}, got {dtype}")
        if len(value.shape) != len(info.shape):
            raise ExecutorError(
                f"input {name!r} must have {len(info.shape)} dimensions {info.shape}, "
                f"got shape {tuple(value.shape)}"
            )
        for dim, want in zip(value.shape, info.shape, strict=True):
            if isinstance(want, int) and want > 0 and dim != want:
                raise ExecutorError(
                    f"input {name!r} must have shape {info.shape}, got {tuple(value.shape)}"
                )
