"""Every way a package can be bad is rejected on load with a message that says what is wrong."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from files.digest import sha256_file
from ir.errors import (
    CorruptModel,
    ForbiddenOperator,
    HashMismatch,
    ManifestError,
    UnsafeExternalData,
)
from ir.export import Encoding
from ir.manifest import MANIFEST_FILE, ModelManifest
from ir.package import load_package, write_manifest
from ir.validate import validate_onnx_file

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def package(minilm: Any, build: Any, tmp_path: Path) -> Path:
    """A fresh copy of a 2-stage MiniLM package that a test may damage."""
    _, directory = build(minilm[0], 2)
    copy = tmp_path / "pkg"
    shutil.copytree(directory, copy)
    return copy


def _stage_file(package: Path, index: int = 1) -> Path:
    manifest = ModelManifest.from_json((package / MANIFEST_FILE).read_bytes())
    return package / manifest.stages[index].file


def _rehash(package: Path, index: int, path: Path) -> None:
    """Make the manifest agree with a (maliciously) changed file, so deeper checks run."""
    manifest = ModelManifest.from_json((package / MANIFEST_FILE).read_bytes())
    sha = sha256_file(path)
    stages = list(manifest.stages)
    stages[index] = type(stages[index])(
        **{**_fields(stages[index]), "sha256": sha, "file": path.name}
    )
    write_manifest(type(manifest)(**{**_fields(manifest), "stages": stages}), package)


def _fields(obj: Any) -> dict[str, Any]:
    return {f: getattr(obj, f) for f in obj.__struct_fields__}


def test_a_good_package_loads(package: Path) -> None:
    assert len(load_package(package).models) == 4


def test_hash_mismatch_is_rejected(package: Path) -> None:
    path = _stage_file(package)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(HashMismatch, match="corrupt or was altered"):
        load_package(package)


def test_truncated_onnx_is_rejected(package: Path) -> None:
    path = _stage_file(package)
    truncated = path.with_name("truncated.onnx")
    truncated.write_bytes(path.read_bytes()[:1000])
    _rehash(package, 1, truncated)
    with pytest.raises(CorruptModel, match="not a readable ONNX file"):
        load_package(package)


def test_garbage_onnx_is_rejected(tmp_path: Path) -> None:
    bad = tmp_path / "x.onnx"
    bad.write_bytes(b"\x08\x07garbage" * 100)
    with pytest.raises(CorruptModel):
        validate_onnx_file(bad, sha256=None, package_dir=tmp_path)


def _tiny_graph(node: onnx.NodeProto, opsets: list[Any] | None = None) -> onnx.ModelProto:
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    return helper.make_model(graph, opset_imports=opsets or [helper.make_opsetid("", 17)])


def test_a_node_in_a_custom_domain_is_rejected(tmp_path: Path) -> None:
    model = _tiny_graph(
        helper.make_node("Evil", ["x"], ["y"], domain="com.example"),
        [helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)],
    )
    path = tmp_path / "custom.onnx"
    onnx.save(model, str(path))
    with pytest.raises(ForbiddenOperator, match=r"com\.example"):
        validate_onnx_file(path, sha256=None, package_dir=tmp_path)


def test_a_non_standard_operator_in_the_default_domain_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "fake-op.onnx"
    onnx.save(_tiny_graph(helper.make_node("NotAnOp", ["x"], ["y"])), str(path))
    with pytest.raises(ForbiddenOperator, match="NotAnOp is not a standard ONNX operator"):
        validate_onnx_file(path, sha256=None, package_dir=tmp_path)


def test_external_data_outside_the_package_is_rejected(tmp_path: Path) -> None:
    outside = tmp_path / "secret.bin"
    outside.write_bytes(np.ones(4, dtype=np.float32).tobytes())
    package_dir = tmp_path / "pkg"
    package_dir.mkdir()
    weight = numpy_helper.from_array(np.ones(4, dtype=np.float32), "w")
    weight.ClearField("raw_data")
    weight.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "../secret.bin"), ("offset", "0"), ("length", "16")):
        entry = weight.external_data.add()
        entry.key, entry.value = key, value
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        [weight],
    )
    path = package_dir / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    with pytest.raises(UnsafeExternalData, match="outside the package directory"):
        validate_onnx_file(path, sha256=None, package_dir=package_dir)


def test_a_manifest_naming_a_path_is_rejected(package: Path) -> None:
    manifest = ModelManifest.from_json((package / MANIFEST_FILE).read_bytes())
    stages = list(manifest.stages)
    stages[1] = type(stages[1])(**{**_fields(stages[1]), "file": "../../etc/passwd"})
    write_manifest(type(manifest)(**{**_fields(manifest), "stages": stages}), package)
    with pytest.raises(ManifestError, match="not a plain file name"):
        load_package(package)


def test_a_malformed_manifest_is_rejected(tmp_path: Path) -> None:
    (tmp_path / MANIFEST_FILE).write_text('{"name": 3}')
    with pytest.raises(ManifestError, match="invalid manifest"):
        load_package(tmp_path)
    with pytest.raises(ManifestError, match="cannot read"):
        load_package(tmp_path / "nowhere")


def test_fp16_weights_and_activations_stay_close_to_fp32(
    minilm: Any, minilm_batch: Any, build: Any
) -> None:
    from ir.executors import OrtExecutor
    from ir.pipeline import LocalPipeline

    ids, mask, ref = minilm_batch
    manifest32, _ = build(minilm[0], 3)
    manifest16, dir16 = build(minilm[0], 3, encoding=Encoding(fp16=True))
    package = load_package(dir16)
    stage = manifest16.provider_stages()[0]
    assert stage.inputs[0].dtype == "float16" and stage.outputs[0].dtype == "float16"
    assert stage.weight_dtype == "float16"
    assert (
        stage.activation_bytes_per_token * 2
        == manifest32.provider_stages()[0].activation_bytes_per_token
    )
    size32 = sum(s.size_bytes for s in manifest32.stages)
    size16 = sum(s.size_bytes for s in manifest16.stages)
    assert size16 < 0.55 * size32
    pipeline = LocalPipeline(manifest16, [OrtExecutor(package.models[i]) for i in range(5)])
    got = pipeline.encode(ids, mask).astype(np.float32)
    cosine = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
    assert cosine.min() >= 0.999, cosine
    # the client's head takes the float32 hidden states a client holds, cast to the stage's dtype
    from client.stages import ClientStages

    pooled = ClientStages(dir16).head(np.ones((2, 4, 384), np.float32), np.ones((2, 4), np.int64))
    assert pooled.shape == (2, 384) and np.isfinite(pooled).all()
