"""Fuzzing what strangers send: every `proto/` message, model manifests and ONNX files.

Each decoder or validator must answer malformed input with its typed error (which the caller
turns into a clear refusal), never crash or hang: the wire codec with `FrameError`, tensors with
`ValueError`, manifests with `ManifestError`, ONNX files with an `IRError`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

import proto.assign
import proto.challenge
import proto.forward
import proto.heartbeat
import proto.join
import proto.ping
import proto.session
import proto.snapshot
import proto.train
from ir.errors import IRError, ManifestError
from ir.manifest import ModelManifest
from ir.validate import validate_onnx_file
from p2p import FrameError, Tensor
from p2p.codec import Message, ProtocolSpec, encode_message

SPECS: list[ProtocolSpec] = [
    spec
    for module in (
        proto.assign,
        proto.challenge,
        proto.forward,
        proto.heartbeat,
        proto.join,
        proto.ping,
        proto.session,
        proto.snapshot,
        proto.train,
    )
    for spec in vars(module).values()
    if isinstance(spec, ProtocolSpec)
]


def _messages(cls: type) -> list[type[Message]]:
    out = []
    for sub in cls.__subclasses__():
        if sub.__module__.startswith("proto."):
            out.append(sub)
        out.extend(_messages(sub))
    return out


MESSAGES = _messages(Message)
TAGS = {m.__struct_config__.tag: m for m in MESSAGES}

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.binary(max_size=64),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
tensors = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(["float32", "float16", "int64", "bool", "object", "<f4", ""]),
        "shape": st.lists(st.integers(-3, 1 << 62), max_size=4),
        "data": st.binary(max_size=64),
    }
)


@st.composite
def near_valid(draw: st.DrawFn) -> bytes:
    """A msgpack map tagged as one of the messages, with its own field names and values of
    any type (tensors shaped like tensors, but wrong in size, dtype or shape)."""
    tag = draw(st.sampled_from(sorted(TAGS)))
    cls = TAGS[tag]
    body: dict[str, Any] = {"type": tag}
    for field in msgspec.structs.fields(cls):
        if draw(st.integers(0, 9)) == 0:
            continue  # a field left out
        if "Tensor" in str(field.type):
            body[field.name] = draw(
                st.one_of(tensors, st.dictionaries(st.text(max_size=8), tensors, max_size=3))
            )
        else:
            body[field.name] = draw(values)
    return msgspec.msgpack.encode(body)


def _arrays(message: Any) -> None:
    """Every tensor in a decoded message converts to an array or raises ValueError."""
    for field in msgspec.structs.fields(message):
        value = getattr(message, field.name)
        items = value.values() if isinstance(value, dict) else [value]
        for item in items:
            if isinstance(item, Tensor):
                try:
                    item.to_numpy()
                except ValueError:
                    pass


@pytest.mark.parametrize("spec", SPECS, ids=[s.protocol_id for s in SPECS])
@given(payload=st.one_of(near_valid(), st.binary(max_size=256)))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_every_protocol_decodes_or_refuses_cleanly(spec: ProtocolSpec, payload: bytes) -> None:
    for decode in (spec.decode_request, spec.decode_response):
        try:
            message = decode(payload)
        except FrameError as exc:
            assert exc.code == "bad_request" and str(exc)
        else:
            assert isinstance(message, Message)
            _arrays(message)


def test_valid_messages_round_trip() -> None:
    """The fuzzer's seeds are real: a well-formed message of each kind decodes unchanged."""
    x = Tensor.from_numpy(np.arange(6, dtype=np.float32).reshape(2, 3))
    forward = proto.forward.Forward(stage="m/1", inputs={"hidden_states": x}, check=True)
    assert proto.forward.FORWARD.decode_request(encode_message(forward)) == forward
    opened = proto.session.SessionOpen(session="s", stage="m/1", check=True)
    assert proto.session.SESSION.decode_request(encode_message(opened)) == opened
    assert len(MESSAGES) >= 20 and len(SPECS) >= 9


# ---- manifests -----------------------------------------------------------------------------


def _manifest() -> dict[str, Any]:
    def stage(i: int, placement: str) -> dict[str, Any]:
        return {
            "index": i,
            "name": f"s{i}",
            "placement": placement,
            "file": f"{i:064x}.onnx",
            "sha256": f"{i:064x}",
            "size_bytes": 100,
            "inputs": [{"name": "hidden_states", "dtype": "float32", "shape": ["batch", 8]}],
            "outputs": [{"name": "hidden_states_out", "dtype": "float32", "shape": ["batch", 8]}],
            "opset": 17,
            "parameter_bytes": 64,
            "flops_per_token": 128,
            "attention_flops_per_token_per_context": 0,
            "activation_bytes_per_token": 32,
            "kv_bytes_per_token": 0,
        }

    return {
        "name": "m",
        "family": "onnx",
        "config": {"hidden_size": 8},
        "stages": [stage(0, "client"), stage(1, "provider")],
    }


@st.composite
def mutated_manifest(draw: st.DrawFn) -> bytes:
    doc = _manifest()
    for _ in range(draw(st.integers(1, 4))):
        target: Any = doc
        path = draw(st.lists(st.sampled_from(["stages", 0, 1, "inputs", "shape"]), max_size=3))
        for key in path:
            in_dict = isinstance(target, dict) and key in target
            in_list = isinstance(target, list) and isinstance(key, int) and key < len(target)
            if in_dict or in_list:
                target = target[key]
        if isinstance(target, dict) and target:
            key = draw(st.sampled_from(sorted(target)))
            if draw(st.booleans()):
                del target[key]
            else:
                target[key] = draw(values)
        elif isinstance(target, list) and target:
            target[draw(st.integers(0, len(target) - 1))] = draw(values)
    raw = json.dumps(doc, default=lambda b: b.hex()).encode()
    if draw(st.booleans()):  # byte-level damage too
        pos = draw(st.integers(0, len(raw)))
        raw = raw[:pos] + draw(st.binary(max_size=8)) + raw[pos + draw(st.integers(0, 8)) :]
    return raw


def test_the_manifest_seed_is_valid() -> None:
    assert ModelManifest.from_json(json.dumps(_manifest()).encode()).name == "m"


@given(raw=mutated_manifest())
@settings(max_examples=400, deadline=None)
def test_a_damaged_manifest_is_refused_with_a_manifest_error(raw: bytes) -> None:
    try:
        manifest = ModelManifest.from_json(raw)
    except ManifestError as exc:
        assert str(exc)
    else:
        assert [s.index for s in manifest.stages] == list(range(len(manifest.stages)))


# ---- ONNX files ----------------------------------------------------------------------------


def _onnx_bytes() -> bytes:
    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 4], np.eye(4, dtype=np.float32).ravel())
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Relu", ["y"], ["z"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", 4])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return bytes(model.SerializeToString())


VALID_ONNX = _onnx_bytes()


@st.composite
def damaged_onnx(draw: st.DrawFn) -> bytes:
    data = bytearray(VALID_ONNX)
    for _ in range(draw(st.integers(1, 6))):
        pos = draw(st.integers(0, len(data) - 1))
        op = draw(st.sampled_from(["flip", "cut", "insert"]))
        if op == "flip":
            data[pos] ^= draw(st.integers(1, 255))
        elif op == "cut":
            del data[pos : pos + draw(st.integers(1, 16))]
        else:
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        if not data:
            break
    return bytes(data)


def test_the_onnx_seed_is_valid(tmp_path: Path) -> None:
    path = tmp_path / "ok.onnx"
    path.write_bytes(VALID_ONNX)
    assert validate_onnx_file(path, sha256=None, package_dir=tmp_path).graph.node[0].op_type


def test_an_operator_name_that_is_not_text_is_refused(tmp_path: Path) -> None:
    """Found by the fuzzer: invalid UTF-8 in a node's op_type reached onnx.defs as bytes."""
    path = tmp_path / "stage.onnx"
    path.write_bytes(VALID_ONNX.replace(b"Relu", b"Re\xffu"))
    with pytest.raises(IRError, match="not valid text"):
        validate_onnx_file(path, sha256=None, package_dir=tmp_path)


@given(data=damaged_onnx())
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_a_damaged_onnx_file_is_refused_with_an_ir_error(
    data: bytes, tmp_path_factory: pytest.TempPathFactory
) -> None:
    folder = tmp_path_factory.mktemp("onnx", numbered=True)
    path = folder / "stage.onnx"
    path.write_bytes(data)
    try:
        model = validate_onnx_file(path, sha256=None, package_dir=folder)
    except IRError as exc:
        assert str(exc)
    else:  # what passes is a well-formed graph of standard operators
        onnx.checker.check_model(model)
        assert all(n.domain in ("", "ai.onnx") for n in model.graph.node)
