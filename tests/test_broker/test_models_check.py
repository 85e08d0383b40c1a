"""A model is registered only if its manifest holds together and matches its files: over the
broker's real HTTP route, each lie is a 400 naming the stage and the field (not a 201, not a
500), and names are matched in full ("tiny-llama\\n" is not a second model)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from broker.models import ModelStore
from files.digest import is_sha256
from ir.gguf.reader import SHARD
from p2p.codec import ProtocolSpec
from proto.ping import Ping, Pong
from tests.test_broker.inproc import Swarm, swarm

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def broker(tmp_path: Path, llama_package: Path) -> AsyncIterator[tuple[Swarm, str]]:
    """An in-process broker whose store holds the tiny Llama's artifacts (the model itself is
    not added yet), and its HTTP address."""
    files = artifacts(llama_package)
    s = await swarm(tmp_path)
    try:
        async with aiohttp.ClientSession() as http:
            for sha, data in files.items():
                url = f"{s.broker.http_url}/v1/artifacts/{sha}"
                async with http.put(url, data=data) as resp:
                    assert resp.status == 201, await resp.text()
        yield s, s.broker.http_url
    finally:
        await s.close()


async def register(http_url: str, manifest: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{http_url}/v1/models", data=json.dumps(manifest).encode()) as resp,
    ):
        return resp.status, await resp.json()


def artifacts(package: Path) -> dict[str, bytes]:
    """A package's files but its manifest, by SHA-256 (their names are `<sha256>.<ext>`)."""
    return {p.name.split(".")[0]: p.read_bytes() for p in package.iterdir() if is_sha256(p.stem)}


def manifest_of(package: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((package / "manifest.json").read_bytes())
    return doc


async def test_a_name_with_a_trailing_newline_is_not_a_second_model(
    broker: tuple[Swarm, str], llama_package: Path
) -> None:
    s, url = broker
    doc = manifest_of(llama_package)
    assert (await register(url, doc))[0] == 201
    status, body = await register(url, {**doc, "name": "tiny-llama\n"})
    assert status == 400 and "model name 'tiny-llama\\n'" in body["error"]["message"]
    assert sorted(s.broker.models.models) == ["tiny-llama"]


@pytest.mark.parametrize(
    ("lie", "message"),
    [
        ({"flops_per_token": -1}, r"stage 1 (layers.0-1): flops_per_token is -1"),
        ({"layers": [2, 0]}, r"stage 1 (layers.0-1): layers [2, 0] must be"),
        ({"opset": 99999}, r"stage 1 (layers.0-1): opset 99999 is outside"),
        ({"size_bytes": 0}, r"stage 1 (layers.0-1): size_bytes is 0"),
        ({"size_bytes": 1234}, r"stage 1 (layers.0-1): size_bytes is 1234, but the file has"),
    ],
)
async def test_a_stage_that_lies_is_refused_with_a_400_naming_it(
    broker: tuple[Swarm, str], llama_package: Path, lie: dict[str, Any], message: str
) -> None:
    s, url = broker
    doc = manifest_of(llama_package)
    doc["stages"][1].update(lie)
    status, body = await register(url, doc)
    assert status == 400, body
    assert message in body["error"]["message"]
    assert not s.broker.models.models


async def test_a_tokenizer_hash_naming_an_onnx_stage_is_refused(
    broker: tuple[Swarm, str], llama_package: Path
) -> None:
    _, url = broker
    doc = manifest_of(llama_package)
    sha = doc["stages"][1]["sha256"]
    status, body = await register(url, {**doc, "tokenizer": f"{sha}.json", "tokenizer_sha256": sha})
    assert status == 400 and "is not a tokenizers JSON file" in body["error"]["message"]


async def test_a_stage_whose_inputs_differ_from_what_the_last_gives_is_refused(
    broker: tuple[Swarm, str], llama_package: Path
) -> None:
    _, url = broker
    doc = manifest_of(llama_package)
    doc["stages"][2]["inputs"][0]["dtype"] = "float16"
    status, body = await register(url, doc)
    assert status == 400
    assert "stage 2 (layers.2-3): input 'hidden_states' is float16" in body["error"]["message"]


def test_a_stored_manifest_refused_now_leaves_its_model_out_after_a_restart(
    tmp_path: Path, llama_package: Path
) -> None:
    """A model kept by a release that checked less is not served (and the broker starts)."""
    store = ModelStore(tmp_path, max_artifact_bytes=1 << 30)
    (store.packages / "old").mkdir()
    (store.packages / "old" / "manifest.json").write_bytes(b"{}")
    doc = manifest_of(llama_package)
    doc["stages"][1]["flops_per_token"] = -1
    assert store.load("old", json.dumps(doc).encode()) is None


def test_names_and_hashes_are_matched_in_full() -> None:
    assert is_sha256("0" * 64) and not is_sha256("0" * 64 + "\n")
    assert SHARD.match("m-00001-of-00002.gguf") and not SHARD.match("m-00001-of-00002.gguf\n")
    ProtocolSpec("/fusionai/ping/1", Ping, Pong)
    with pytest.raises(ValueError, match="must look like"):
        ProtocolSpec("/fusionai/ping/1\n", Ping, Pong)
