"""Tensors on the wire: dtype name, shape and raw little-endian bytes. Never pickled.

`Tensor.from_numpy` makes no copy of a C-contiguous array (the encoder copies once into the
frame); a decoded `Tensor` refers to the received buffer, and `to_numpy()` wraps it without a
copy (the array is then read-only; pass `copy=True` for a writable one).
"""

from __future__ import annotations

import sys
from typing import Any

import msgspec
import numpy as np

try:  # bfloat16 comes from ml_dtypes (installed with onnx); without it, bfloat16 is refused.
    import ml_dtypes

    _BFLOAT16: np.dtype[Any] | None = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - depends on the environment
    _BFLOAT16 = None

MAX_NDIM = 16

DTYPES: dict[str, np.dtype[Any]] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "float64": np.dtype("<f8"),
    "int64": np.dtype("<i8"),
    "int32": np.dtype("<i4"),
    "int8": np.dtype("i1"),
    "uint8": np.dtype("u1"),
    "bool": np.dtype("?"),
}
if _BFLOAT16 is not None:
    DTYPES["bfloat16"] = _BFLOAT16

_NAMES = {dt: name for name, dt in DTYPES.items()}


class Tensor(msgspec.Struct, frozen=True, array_like=True):
    """An n-dimensional array: `dtype` (a name in `DTYPES`), `shape`, and C-order bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: memoryview

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; supported: {sorted(DTYPES)}")
        if len(self.shape) > MAX_NDIM:
            raise ValueError(f"a tensor has at most {MAX_NDIM} dimensions, got {len(self.shape)}")
        count = 1
        for dim in self.shape:
            if dim < 0:
                raise ValueError(f"negative dimension in shape {self.shape}")
            count *= dim
        expected = count * DTYPES[self.dtype].itemsize
        if self.data.nbytes != expected:
            raise ValueError(
                f"a {self.dtype} tensor of shape {self.shape} has {expected} bytes, "
                f"got {self.data.nbytes}"
            )

    @classmethod
    def from_numpy(cls, array: np.ndarray[Any, Any]) -> Tensor:
        """Wrap a numpy array (copied only if it is not C-contiguous little-endian)."""
        if array.dtype.byteorder == ">" or (
            array.dtype.byteorder == "=" and sys.byteorder == "big"
        ):
            array = array.astype(array.dtype.newbyteorder("<"))
        name = _NAMES.get(array.dtype)
        if name is None:
            raise ValueError(f"unsupported dtype {array.dtype}; supported: {sorted(DTYPES)}")
        flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        return cls(name, tuple(int(d) for d in array.shape), flat.data)

    def to_numpy(self, *, copy: bool = False) -> np.ndarray[Any, Any]:
        """The array; shares the buffer (read-only if the buffer is) unless `copy`."""
        array = np.frombuffer(self.data, dtype=DTYPES[self.dtype]).reshape(self.shape)
        return array.copy() if copy else array

    @property
    def nbytes(self) -> int:
        return self.data.nbytes
