"""A manifest is checked against itself (figures, dtypes, layer ranges, the stage chain) when
it is decoded, and against its files when a package is loaded: every lie is a `ManifestError`
naming the stage and the field."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ir.consistency import DTYPES, WEIGHT_DTYPES, max_opset
from ir.errors import ManifestError
from ir.manifest import MANIFEST_FILE, ModelManifest
from ir.package import load_package

pytestmark = pytest.mark.timeout(120)
Doc = dict[str, Any]


@pytest.fixture
def doc(llama_package: Path) -> Doc:
    """The tiny Llama's manifest as JSON (embed, blocks 0-1, blocks 2-3, head), to damage."""
    loaded: Doc = json.loads((llama_package / MANIFEST_FILE).read_bytes())
    return loaded


def decode(doc: Doc) -> ModelManifest:
    return ModelManifest.from_json(json.dumps(doc).encode())


def _set(path: str, value: Any) -> Callable[[Doc], None]:
    """A change to one field, at a dotted path such as `stages.1.layers`."""

    def change(doc: Doc) -> None:
        *parents, last = path.split(".")
        target: Any = doc
        for key in parents:
            target = target[int(key)] if isinstance(target, list) else target[key]
        target[int(last) if isinstance(target, list) else last] = value

    return change


# (change, what the error must say): each was accepted before manifests were checked.
LIES = {
    "reversed layers": (
        _set("stages.1.layers", [2, 0]),
        r"stage 1 \(layers.0-1\): layers \[2, 0\]",
    ),
    "empty layers": (_set("stages.2.layers", [2, 2]), r"stage 2 .*reversed or empty"),
    "a gap between layers": (_set("stages.2.layers", [3, 4]), r"stage 2 .*start at block 2"),
    "layers short of the model": (_set("stages.2.layers", [2, 3]), "config.num_layers is 4"),
    "zero size": (_set("stages.1.size_bytes", 0), r"stage 1 .*size_bytes is 0"),
    "opset 99999": (_set("stages.2.opset", 99999), r"stage 2 .*opset 99999 is outside"),
    "an unknown dtype": (
        _set("stages.1.inputs.1.dtype", "float128"),
        r"stage 1 .*input 'position_ids': dtype 'float128'",
    ),
    "an unknown weight dtype": (_set("stages.1.weight_dtype", "int3"), "weight_dtype 'int3'"),
    "a negative flops_per_token": (
        _set("stages.1.flops_per_token", -1),
        r"stage 1 .*flops_per_token is -1",
    ),
    "a huge byte figure": (_set("stages.2.parameter_bytes", 10**30), "parameter_bytes is 1000"),
    "a negative dimension": (_set("stages.3.outputs.0.shape", ["batch", "sequence", -512]), "-512"),
    "an input the stage before does not give": (
        _set("stages.2.inputs.0.name", "hidden"),
        r"stage 2 .*takes none of what stage 1 .*gives",
    ),
    "a chained dtype that differs": (
        _set("stages.2.inputs.0.dtype", "float16"),
        r"stage 2 .*'hidden_states' is float16 .*stage 1 .*as float32",
    ),
    "a chained size that differs": (
        _set("stages.3.inputs.0.shape", ["batch", "sequence", 64]),
        r"stage 3 \(head\): input 'hidden_states' is float32 \['batch', 'sequence', 64\]",
    ),
    "a stage sha256 that is no hash": (_set("stages.1.sha256", "abc"), "stage 1 .*sha256"),
    "a tokenizer without its hash": (_set("tokenizer_sha256", None), "give both or neither"),
    "a tokenizer in another folder": (_set("tokenizer", "../tok.json"), "not a plain file name"),
    "a zero vocabulary": (_set("config.vocab_size", 0), "config.vocab_size is 0"),
    "a negative stop token": (_set("stop_token_ids", [-1]), "stop_token_ids"),
    "no stages": (_set("stages", []), "no stages"),
}


@pytest.mark.parametrize("case", sorted(LIES))
def test_a_manifest_that_contradicts_itself_is_refused(doc: Doc, case: str) -> None:
    change, message = LIES[case]
    decode(doc)  # the real package's manifest passes
    change(doc)
    with pytest.raises(ManifestError, match=message):
        decode(doc)


def test_the_known_dtypes_are_those_the_exporters_write_and_the_wire_carries() -> None:
    from ir.package import _ONNX_DTYPES
    from ir.quantize import DTYPES as QUANTIZED
    from p2p.tensor import DTYPES as WIRE

    assert set(DTYPES) == set(_ONNX_DTYPES.values()) == set(WIRE)
    assert set(WEIGHT_DTYPES) == set(QUANTIZED.values())
    assert max_opset() >= 21  # the quantized stages' opset is within reach


# ---- against the files ----------------------------------------------------------------------


@pytest.fixture
def package(llama_package: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "pkg"
    shutil.copytree(llama_package, copy)
    return copy


def rewrite(package: Path, *changes: Callable[[Doc], None]) -> None:
    doc = json.loads((package / MANIFEST_FILE).read_bytes())
    for change in changes:
        change(doc)
    (package / MANIFEST_FILE).write_text(json.dumps(doc))


def test_the_real_package_agrees_with_its_files(package: Path) -> None:
    assert len(load_package(package).models) == 4


def test_a_declared_size_other_than_the_files_is_refused(package: Path) -> None:
    stage = json.loads((package / MANIFEST_FILE).read_bytes())["stages"][1]
    rewrite(package, _set("stages.1.size_bytes", (package / stage["file"]).stat().st_size + 1))
    with pytest.raises(ManifestError, match=r"stage 1 \(layers.0-1\): size_bytes is \d+, but"):
        load_package(package)


def test_a_declared_opset_other_than_the_files_is_refused(package: Path) -> None:
    rewrite(package, _set("stages.2.opset", 18))
    with pytest.raises(ManifestError, match=r"stage 2 .*opset is 18, but the file imports opset"):
        load_package(package)


def test_declared_weight_bytes_other_than_the_files_are_refused(package: Path) -> None:
    rewrite(package, _set("stages.1.parameter_bytes", 1))
    with pytest.raises(ManifestError, match=r"stage 1 .*parameter_bytes is 1, but the file"):
        load_package(package)


def test_a_declared_dtype_the_file_does_not_have_is_refused(package: Path) -> None:
    """Consistent in the manifest (embed gives, blocks take fp16), false of the files."""
    rewrite(
        package,
        _set("stages.0.outputs.0.dtype", "float16"),
        _set("stages.1.inputs.0.dtype", "float16"),
    )
    decode(json.loads((package / MANIFEST_FILE).read_bytes()))
    with pytest.raises(
        ManifestError, match=r"stage 0 \(embed\): output 'hidden_states' is float16 .* float32"
    ):
        load_package(package)


def test_a_declared_shape_the_file_does_not_have_is_refused(package: Path) -> None:
    rewrite(package, _set("stages.1.inputs.3.shape", ["batch", 2, "past", 16]))
    with pytest.raises(ManifestError, match=r"stage 1 .*input 'past_key.0' is .* in the file"):
        load_package(package)


def test_a_tokenizer_hash_naming_an_onnx_file_is_refused(package: Path) -> None:
    stage = json.loads((package / MANIFEST_FILE).read_bytes())["stages"][1]
    tokenizer = f"{stage['sha256']}.json"
    shutil.copyfile(package / stage["file"], package / tokenizer)
    rewrite(package, _set("tokenizer", tokenizer), _set("tokenizer_sha256", stage["sha256"]))
    with pytest.raises(ManifestError, match="is not a tokenizers JSON file"):
        load_package(package)
