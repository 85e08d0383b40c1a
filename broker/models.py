"""The model store: packages (IR manifest + ONNX files) kept by the broker, addressed by SHA-256.

Artifacts live in `data_dir/artifacts/<sha256>` whatever model they belong to, so two models
sharing a stage store it once. An upload streams to a temporary file, is hashed on the way and
renamed into place only if the hash matches. A model is registered from its manifest once every
file it names is present; the package is then validated as a whole (IR validation: standard
ONNX operators only, hashes, sizes; each stage's inputs, outputs, dtypes, shapes and opset
against its file and the stage before it; the tokenizer a tokenizer), so providers are never
sent a stage the broker has not checked.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from client.stages import ClientStages
from dag.model import ModelSpec
from files.atomic import write_atomic
from files.cache import ArtifactCache, ArtifactError
from files.digest import is_sha256
from ir.errors import IRError
from ir.manifest import ModelManifest
from ir.package import load_package

log = logging.getLogger(__name__)

# Whole names: `\Z`, unlike `$`, matches no trailing newline ("minilm\n" is refused).
NAME_RE = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")
FILE_RE = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,199}\Z")


class ModelStoreError(ValueError):
    """A model or artifact was refused; the message says why and what to do."""


@dataclass(frozen=True)
class StoredModel:
    manifest: ModelManifest
    manifest_bytes: bytes
    directory: Path  # a package directory: manifest.json plus links to the artifacts
    created: float  # Unix time it was added (its manifest.json written)

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def units(self) -> list[int]:
        """Manifest indices of the stages providers run, in pipeline order."""
        return [s.index for s in self.manifest.stages if s.placement == "provider"]

    def unit_key(self, index: int) -> str:
        return f"{self.name}/{index}"


def model_spec(manifest: ModelManifest) -> ModelSpec:
    """The placement's view of a package: each provider stage is one indivisible block.

    Figures are per stage: the mean compute, and the largest weights (memory must fit any)."""
    stages = [s for s in manifest.stages if s.placement == "provider"]
    if not stages:
        raise ModelStoreError(f"model {manifest.name} has no stage for providers to run")
    n = len(stages)
    return ModelSpec(
        name=manifest.name,
        n_layers=n,
        layer_flops_per_token=sum(s.flops_per_token for s in stages) / n,
        layer_attn_flops_per_token_per_context=sum(
            s.attention_flops_per_token_per_context for s in stages
        )
        / n,
        layer_param_bytes=float(max(max(s.parameter_bytes, s.size_bytes) for s in stages)),
        layer_kv_bytes_per_token=max(s.kv_bytes_per_token for s in stages),
        hidden_bytes_per_token=max(s.activation_bytes_per_token for s in stages),
    )


class ModelStore:
    def __init__(self, root: Path, max_artifact_bytes: int) -> None:
        self.cache = ArtifactCache(
            root / "artifacts"
        )  # no limit: the models served, the adapters trained
        self.cache.adopt(self.cache.root)  # an earlier release kept them flat
        self.cache.adopt(root / "adapters", ".safetensors")  # and fine-tunes' adapters apart
        self.cache.check(verify=False)  # every file was verified before it was kept
        self.packages = root / "models"
        self.incoming = root / "incoming"
        for d in (self.packages, self.incoming):
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.max_artifact_bytes = max_artifact_bytes
        self.models: dict[str, StoredModel] = {}
        self._clients: dict[str, ClientStages] = {}

    def client(self, name: str) -> ClientStages:
        """The model's client-side stages (tokenizer, embedding, head), loaded once; a new
        version of the model drops them. Loads files: call it off the event loop."""
        stages = self._clients.get(name)
        if stages is None:
            stages = self._clients[name] = ClientStages(self.models[name].directory)
        return stages

    def artifact_path(self, sha: str) -> Path | None:
        if not is_sha256(sha) or not self.cache.has(sha):
            return None
        return self.cache.path(sha)

    async def receive(self, sha: str, chunks: AsyncIterator[bytes]) -> int:
        """Store an uploaded artifact if its bytes hash to `sha`; returns its size."""
        if not is_sha256(sha):
            raise ModelStoreError("an artifact is named by its SHA-256: 64 lowercase hex digits")
        try:
            return await self.cache.receive(sha, chunks, self.max_artifact_bytes)
        except ArtifactError as exc:
            raise ModelStoreError(f"artifact {sha[:12]} refused: {exc}") from None

    def register(self, manifest_bytes: bytes) -> StoredModel:
        """Validate and register a model whose artifacts are all stored."""
        try:
            manifest = ModelManifest.from_json(manifest_bytes)
        except IRError as exc:
            raise ModelStoreError(f"manifest: {exc}") from None
        if not NAME_RE.fullmatch(manifest.name):
            raise ModelStoreError(
                f"model name {manifest.name!r}: use 1-64 letters, digits, '.', '_' or '-'"
            )
        named = [(s.file, s.sha256) for s in manifest.stages]
        if manifest.tokenizer is not None and manifest.tokenizer_sha256 is not None:
            named.append((manifest.tokenizer, manifest.tokenizer_sha256))
        files: dict[str, str] = {}
        for file, sha in named:
            if files.setdefault(file, sha) != sha:
                raise ModelStoreError(
                    f"model {manifest.name}: the manifest names two different artifacts "
                    f"{file!r}; give each file its own name (the export tools use <sha256>.onnx)"
                )
        missing = sorted(sha for sha in files.values() if self.artifact_path(sha) is None)
        if missing:
            raise ModelStoreError(
                f"model {manifest.name}: upload these artifacts first (PUT /v1/artifacts/SHA): "
                f"{', '.join(missing)}"
            )
        for file in files:
            if not FILE_RE.fullmatch(file) or file == "manifest.json":
                raise ModelStoreError(
                    f"manifest names the file {file!r}: use a plain name of letters, digits, "
                    f"'.', '_' or '-' (the export tools use <sha256>.onnx), not manifest.json"
                )
        staging = Path(tempfile.mkdtemp(dir=self.incoming, prefix="pkg-"))
        try:
            for file, sha in files.items():
                os.link(self.cache.path(sha), staging / file)
            write_atomic(staging / "manifest.json", manifest_bytes, mode=0o600, sync=False)
            try:
                load_package(staging)
            except IRError as exc:
                raise ModelStoreError(f"model {manifest.name} failed validation: {exc}") from None
            model_spec(manifest)
            target = self.packages / manifest.name
            old = self.packages / f".{manifest.name}.old"
            if target.exists():
                os.replace(target, old)
            os.replace(staging, target)
            shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        target = self.packages / manifest.name
        stored = StoredModel(
            manifest, manifest_bytes, target, (target / "manifest.json").stat().st_mtime
        )
        self.models[manifest.name] = stored
        self._clients.pop(manifest.name, None)
        return stored

    def load(self, name: str, manifest_bytes: bytes) -> StoredModel | None:
        """A model registered before a restart (None if its package has gone, or if its
        manifest fails this release's checks)."""
        directory = self.packages / name
        if not (directory / "manifest.json").is_file():
            return None
        try:
            manifest = ModelManifest.from_json(manifest_bytes)
        except IRError as exc:  # kept by a release that checked less: add the model again
            log.warning("model %s is not served: its manifest is refused now: %s", name, exc)
            return None
        created = (directory / "manifest.json").stat().st_mtime
        stored = StoredModel(manifest, manifest_bytes, directory, created)
        self.models[name] = stored
        return stored
