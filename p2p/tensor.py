"""Tensors on the wire: dtype name, shape and raw little-endian bytes. Never pickled.

`Tensor.from_numpy` makes no copy of a C-contiguous array (the encoder copies once into the
frame); a decoded `Tensor` refers to the received buffer, and `to_numpy()` wraps it without a
copy (the array is then read-only; pass `copy=True` for a writable one).

The int8 wire format (`encode(array, "int8")`) sends a float array as int8 with one float32
scale per block of `WIRE_BLOCK` values along its last axis (a token's hidden state is
`hidden / 64` blocks): 1.0625 bytes a value instead of 4, each value within half a step
(1/254 of its block's largest magnitude). Blocks rather than one scale per token keep the few
outlier channels of a transformer's residual stream from flattening every other channel of
that token. Such a tensor has dtype `INT8_BLOCKS` (a peer that does not know it refuses it
by name), and its `to_numpy()` is the de-quantized float32 array.
"""

from __future__ import annotations

import math
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
WIRE_BLOCK = 64  # values per scale in the int8 wire format
INT8_BLOCKS = "int8x64"  # the dtype name of an int8-wire tensor

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
    """An n-dimensional array: `dtype` (a name in `DTYPES`, or `INT8_BLOCKS`), `shape`, and
    C-order bytes (for `INT8_BLOCKS`: the int8 values, then one float32 scale per block)."""

    dtype: str
    shape: tuple[int, ...]
    data: memoryview

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES and self.dtype != INT8_BLOCKS:
            raise ValueError(
                f"unsupported dtype {self.dtype!r}; supported: {sorted(DTYPES)} and "
                f"{INT8_BLOCKS!r} (int8 blocks)"
            )
        if len(self.shape) > MAX_NDIM:
            raise ValueError(f"a tensor has at most {MAX_NDIM} dimensions, got {len(self.shape)}")
        count = 1
        for dim in self.shape:
            if dim < 0:
                raise ValueError(f"negative dimension in shape {self.shape}")
            count *= dim
        if self.dtype == INT8_BLOCKS:
            if not self.shape or count == 0:
                raise ValueError(f"an {INT8_BLOCKS} tensor holds at least one value")
            expected = count + 4 * (count // block_of(self.shape[-1]))
        else:
            expected = count * DTYPES[self.dtype].itemsize
        if self.data.nbytes != expected:
            raise ValueError(
                f"a {self.dtype} tensor of shape {self.shape} has {expected} bytes, "
                f"got {self.data.nbytes}"
            )
        if self.dtype == INT8_BLOCKS and not np.isfinite(self._scales(count)).all():
            raise ValueError(f"an {INT8_BLOCKS} tensor has a scale that is not a finite number")

    def _scales(self, count: int) -> np.ndarray[Any, Any]:
        return np.frombuffer(self.data, dtype="<f4", offset=count)

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

    @classmethod
    def int8_blocks(cls, array: np.ndarray[Any, Any]) -> Tensor:
        """A non-empty float array in the int8 wire format."""
        q, scales = quantize_blocks(array)
        data = np.concatenate([q.view(np.uint8), scales.view(np.uint8)])
        return cls(INT8_BLOCKS, tuple(int(d) for d in array.shape), data.data)

    @property
    def wire(self) -> str:
        return "int8" if self.dtype == INT8_BLOCKS else "native"

    def to_numpy(self, *, copy: bool = False) -> np.ndarray[Any, Any]:
        """The array; shares the buffer (read-only if the buffer is) unless `copy`. An
        int8-wire tensor is de-quantized into a new float32 array."""
        if self.dtype == INT8_BLOCKS:
            count = math.prod(self.shape)
            scales = self._scales(count)
            q = np.frombuffer(self.data, dtype=np.int8, count=count).reshape(len(scales), -1)
            return (q.astype(np.float32) * scales[:, None]).reshape(self.shape)
        array = np.frombuffer(self.data, dtype=DTYPES[self.dtype]).reshape(self.shape)
        return array.copy() if copy else array

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


def block_of(last: int) -> int:
    """Values per scale in the int8 wire format for a last axis of `last` values."""
    return WIRE_BLOCK if last % WIRE_BLOCK == 0 else max(last, 1)


def quantize_blocks(
    array: np.ndarray[Any, Any],
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """(int8 values, float32 scales) of a float array, symmetric, one scale per block."""
    if not np.issubdtype(array.dtype, np.floating) or array.size == 0 or array.ndim == 0:
        raise ValueError(
            f"the int8 wire format takes non-empty float arrays, not {array.dtype} of shape "
            f"{array.shape}"
        )
    values = np.asarray(array, dtype=np.float32).reshape(-1, block_of(array.shape[-1]))
    if not np.isfinite(values).all():
        raise ValueError("the int8 wire format takes finite values only")
    scales = np.abs(values).max(axis=1) / 127
    scales = np.where(scales > 0, scales, 1.0).astype("<f4")
    q = np.rint(values / scales[:, None]).astype(np.int8)
    return q.reshape(-1), scales


def encode(array: np.ndarray[Any, Any], wire: str = "native") -> Tensor:
    """`array` as a tensor in `wire` format ("native": as it is; "int8": int8 blocks)."""
    if wire == "native" or (wire == "int8" and array.size == 0):
        return Tensor.from_numpy(array)
    if wire == "int8":
        return Tensor.int8_blocks(array)
    raise ValueError(f"unknown wire format {wire!r}; known: native, int8")


def through_wire(array: np.ndarray[Any, Any], wire: str) -> np.ndarray[Any, Any]:
    """What the receiver of `array` sent in `wire` format gets (for runs on one machine that
    must compute what the swarm computes)."""
    return array if wire == "native" else encode(array, wire).to_numpy()
