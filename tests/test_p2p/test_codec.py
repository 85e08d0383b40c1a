"""The wire codec: framing, reassembly, typed messages and tensors, without sockets."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from p2p import FrameError, Message, ProtocolSpec, Tensor
from p2p.codec import (
    FLAG_MORE,
    HEADER,
    Frame,
    FrameDecoder,
    Kind,
    Reassembler,
    encode_frames,
    encode_message,
)
from p2p.testing import ECHO_CONTROL, Echo


def test_frames_split_and_reassemble_across_arbitrary_read_boundaries() -> None:
    payload = bytes(range(256)) * 1000
    wire = b"".join(encode_frames(Kind.REQUEST, 7, payload, chunk_size=10_000))
    decoder, reasm = FrameDecoder(max_frame=10_000), Reassembler(max_message=1 << 20)
    out = []
    for i in range(0, len(wire), 333):  # reads that cut headers and payloads anywhere
        for frame in decoder.feed(wire[i : i + 333]):
            assert frame.call_id == 7
            whole = reasm.add(frame)
            if whole is not None:
                out.append(whole)
    assert out == [payload]
    assert decoder.buffered == 0 and reasm.buffered == 0


def test_a_frame_over_the_limit_is_a_typed_error() -> None:
    decoder = FrameDecoder(max_frame=1000)
    with pytest.raises(FrameError) as info:
        decoder.feed(HEADER.pack(1001, Kind.REQUEST, 0, 1) + b"x" * 10)
    assert info.value.code == "too_large"


def test_an_oversized_message_fails_once_and_the_stream_stays_usable() -> None:
    reasm = Reassembler(max_message=100)
    with pytest.raises(FrameError, match="too_large"):
        reasm.add(Frame(Kind.REQUEST, FLAG_MORE, 1, b"a" * 60))
        reasm.add(Frame(Kind.REQUEST, FLAG_MORE, 1, b"a" * 60))
    assert reasm.add(Frame(Kind.REQUEST, 0, 1, b"a" * 60)) is None  # rest dropped quietly
    assert reasm.add(Frame(Kind.REQUEST, 0, 2, b"ok")) == b"ok"


def test_messages_are_typed_frozen_and_reject_wrong_types() -> None:
    msg = Echo(data=b"x", n=3)
    with pytest.raises(AttributeError):
        msg.n = 4  # type: ignore[misc]
    assert ECHO_CONTROL.decode_request(encode_message(msg)) == msg
    with pytest.raises(FrameError, match="invalid message") as info:
        ECHO_CONTROL.decode_request(msgspec.msgpack.encode({"type": "Echo/1", "n": "three"}))
    assert info.value.code == "bad_request"
    with pytest.raises(FrameError, match="invalid message"):
        ECHO_CONTROL.decode_request(msgspec.msgpack.encode({"type": "Evil", "n": 1}))
    with pytest.raises(FrameError, match="malformed message"):
        ECHO_CONTROL.decode_request(b"\xc1")


def test_protocol_ids_are_checked() -> None:
    with pytest.raises(ValueError, match="/fusionai/<name>/<version>"):
        ProtocolSpec("/echo/1.0.0", Echo, Echo)


class Unversioned(Message, frozen=True):
    x: int = 0


class EchoV2(Message, frozen=True, tag="Echo/2"):
    data: bytes = b""


def test_message_types_must_carry_a_versioned_tag() -> None:
    with pytest.raises(ValueError, match='tag="Unversioned/1"'):
        ProtocolSpec("/fusionai/test-unversioned/1", Unversioned, Echo)


def test_a_message_of_another_version_is_a_clear_error() -> None:
    with pytest.raises(FrameError, match=r"Echo/2.*\$\.type") as info:
        ECHO_CONTROL.decode_request(encode_message(EchoV2(data=b"x")))
    assert info.value.code == "bad_request"


class Holder(Message, frozen=True, tag="Holder/1"):
    t: Tensor


@pytest.mark.parametrize(
    "dtype",
    ["float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8", "bool"],
)
def test_tensors_round_trip_bit_exact_for_every_dtype(dtype: str) -> None:
    from p2p.tensor import DTYPES

    rng = np.random.default_rng(0)
    array = (rng.standard_normal((3, 5, 7)) * 100).astype(DTYPES[dtype])
    wire = encode_message(Holder(t=Tensor.from_numpy(array)))
    back = msgspec.msgpack.decode(wire, type=Holder).t.to_numpy()
    assert back.dtype == array.dtype and back.shape == array.shape
    assert back.tobytes() == array.tobytes()


def test_tensor_decoding_shares_the_buffer_and_encoding_makes_no_copy() -> None:
    array = np.arange(1000, dtype=np.float32)
    tensor = Tensor.from_numpy(array)
    assert np.shares_memory(tensor.to_numpy(), array)
    wire = encode_message(Holder(t=tensor))
    back = msgspec.msgpack.decode(wire, type=Holder).t
    assert back.data.obj is wire  # a view into the received bytes, not a copy
    assert not back.to_numpy().flags.writeable and back.to_numpy(copy=True).flags.writeable


def test_non_contiguous_and_big_endian_arrays_are_normalised() -> None:
    array = np.arange(24, dtype=">i4").reshape(4, 6)[:, ::2]
    back = Tensor.from_numpy(array).to_numpy()
    assert back.dtype == np.dtype("<i4") and np.array_equal(back, array)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (["float32", [2, 2], b"\0" * 15], "has 16 bytes, got 15"),
        (["complex64", [1], b"\0" * 8], "unsupported dtype"),
        (["float32", [-1], b""], "negative dimension"),
        (["float32", [1] * 17, b"\0" * 4], "at most 16 dimensions"),
        (["int8x64", [2, 64], b"\0" * 128], "has 136 bytes, got 128"),
        (["int8x64", [2, 100], b"\0" * 212], "has 208 bytes, got 212"),  # a scale per row
        (["int8x64", [2, 0], b""], "at least one value"),
        (["int8x64", [], b"\0" * 5], "at least one value"),
        (["int8x64", [2, 64], b"\0" * 128 + np.float32([1, np.nan]).tobytes()], "not a finite"),
    ],
)
def test_invalid_tensors_are_rejected_on_decode(fields: list[object], match: str) -> None:
    spec = ProtocolSpec("/fusionai/test-holder/1", Holder, Holder)
    wire = msgspec.msgpack.encode({"type": "Holder/1", "t": fields})
    with pytest.raises(FrameError, match=match):
        spec.decode_request(wire)


def test_object_arrays_cannot_be_sent() -> None:
    with pytest.raises(ValueError, match="unsupported dtype"):
        Tensor.from_numpy(np.array([object()]))


def test_the_int8_wire_format_sends_a_quarter_of_the_bytes_within_half_a_step() -> None:
    """One float32 scale per 64 values of the last axis; each value comes back within half
    a step (1/254 of its block's largest magnitude); one outlier channel costs precision
    only in its own block, not across the token."""
    from p2p.tensor import encode, through_wire

    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((2, 5, 256)).astype(np.float32)
    hidden[0, 1, 7] = 3000.0  # a massive activation in one channel of one token
    tensor = encode(hidden, "int8")
    assert tensor.wire == "int8" and tensor.dtype == "int8x64"
    assert tensor.nbytes == hidden.size + 4 * hidden.size // 64 == 0.265625 * hidden.nbytes
    frame = encode_message(Holder(t=tensor))
    assert len(frame) < 0.27 * hidden.nbytes + 64
    back = msgspec.msgpack.decode(frame, type=Holder).t.to_numpy()
    assert back.dtype == np.float32 and back.shape == hidden.shape
    blocks = np.abs(hidden).reshape(-1, 64).max(axis=1, keepdims=True)
    error = np.abs(back - hidden).reshape(-1, 64)
    assert (error <= blocks / 254 * (1 + 1e-5)).all()
    others = np.abs(back - hidden)[0, 1, 64:]  # the outlier token's other blocks
    assert others.max() <= 4 / 254  # standard normal values: their own scale, not 3000's
    assert np.array_equal(through_wire(back, "int8"), back)  # sending it on adds nothing
    assert through_wire(hidden, "native") is hidden
    odd = rng.standard_normal((3, 100)).astype(np.float32)  # not a multiple of 64: per row
    assert encode(odd, "int8").nbytes == 300 + 4 * 3
    assert encode(np.zeros((1, 0, 64), np.float32), "int8").wire == "native"  # nothing to scale


def test_only_finite_float_arrays_go_out_as_int8() -> None:
    from p2p.tensor import encode

    for bad, match in (
        (np.array([[1.0, np.inf]], np.float32), "finite values only"),
        (np.arange(64).reshape(1, 64), "float arrays"),
    ):
        with pytest.raises(ValueError, match=match):
            encode(bad, "int8")
    with pytest.raises(ValueError, match="unknown wire format 'int3'"):
        encode(np.zeros((1, 64), np.float32), "int3")
