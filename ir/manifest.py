"""The model manifest: versioned JSON describing every stage of a model package.

A model package is a directory holding `manifest.json` and the files it names, each named by
its SHA-256 (`<hex>.onnx`), so a package is content-addressed and any file can be fetched and
verified by hash alone.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from ir.consistency import check_manifest
from ir.errors import ManifestError

FORMAT = "fusionai.model"
VERSION = 1
MANIFEST_FILE = "manifest.json"

Dim = int | str  # a fixed size, or a symbol such as "batch", "sequence", "past"


class TensorInfo(msgspec.Struct, frozen=True):
    name: str
    dtype: str  # "float32", "float16", "int64", ...: one of `ir.consistency.DTYPES`
    shape: list[Dim]


class AdapterInfo(msgspec.Struct, frozen=True):
    """A LoRA adapter slot: `y = W x + (x A^T) B^T`, with A and B given as graph inputs."""

    target: str  # e.g. "layers.3.q"
    a_input: str  # graph input holding A, shape (rank, in_features)
    b_input: str  # graph input holding B, shape (out_features, rank)
    in_features: int
    out_features: int


class StageInfo(msgspec.Struct, frozen=True):
    index: int
    name: str  # "embed", "layers.0-2", "head", ...
    placement: Literal["client", "provider"]
    file: str  # "<sha256>.onnx", relative to the package directory
    sha256: str
    size_bytes: int
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    opset: int
    parameter_bytes: int
    flops_per_token: int  # multiply-adds x 2 of the weights, per token
    attention_flops_per_token_per_context: int  # extra FLOPs per token per context token
    activation_bytes_per_token: int  # bytes this stage sends on per token
    kv_bytes_per_token: int  # KV-cache bytes this stage keeps per token of context
    layers: list[int] | None = None  # [first, last + 1] of the model's blocks
    adapters: list[AdapterInfo] = msgspec.field(default_factory=list)
    weight_dtype: str = "float32"  # one of `ir.consistency.WEIGHT_DTYPES`


LONGROPE_KEY = "longrope_original_max_positions"
# How hidden states travel between stages: as the graph has them (fp32, or fp16 for an fp16
# package), or as int8 with a float32 scale per 64 values (p2p.tensor's int8 wire format).
WIRES = ("native", "int8")


class ModelManifest(msgspec.Struct, frozen=True):
    name: str
    family: str  # "bert", "gpt2", "llama", "mistral", "qwen2", ..., "onnx"
    config: dict[str, int | float | str]
    stages: list[StageInfo]
    tokenizer: str | None = None  # "<sha256>.json" (a tokenizers JSON file), if shipped
    tokenizer_sha256: str | None = None
    chat_template: str | None = None  # the model's own (Jinja), from its tokenizer files
    special_tokens: dict[str, str] = msgspec.field(default_factory=dict)  # bos_token, ...
    stop_token_ids: list[int] = msgspec.field(default_factory=list)  # every end-of-turn id
    wire: str = "native"  # one of WIRES
    format: str = FORMAT
    version: int = VERSION

    def to_json(self) -> bytes:
        return msgspec.json.format(msgspec.json.encode(self), indent=2)

    @classmethod
    def from_json(cls, data: bytes) -> ModelManifest:
        try:
            manifest = msgspec.json.decode(data, type=cls)
        except msgspec.ValidationError as exc:
            raise ManifestError(f"invalid manifest: {exc}") from None
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            raise ManifestError(f"manifest is not valid JSON: {exc}") from None
        except RecursionError:
            raise ManifestError("manifest is not valid: its JSON is nested too deeply") from None
        if manifest.format != FORMAT:
            raise ManifestError(f"not a model manifest (format {manifest.format!r})")
        if manifest.version > VERSION:
            raise ManifestError(
                f"manifest version {manifest.version} is newer than this FusionAI supports "
                f"({VERSION}); upgrade fusionai"
            )
        if manifest.wire not in WIRES:
            raise ManifestError(
                f"unknown wire format {manifest.wire!r}; this FusionAI knows {', '.join(WIRES)}"
            )
        vocab = manifest.config.get("vocab_size")
        if isinstance(vocab, int) and any(not 0 <= t < vocab for t in manifest.stop_token_ids):
            raise ManifestError(f"stop_token_ids {manifest.stop_token_ids} leave 0..{vocab - 1}")
        check_manifest(manifest)  # figures, dtypes, layer ranges, each stage fed by the last
        return manifest

    def cache_valid_until(self) -> int | None:
        """The context length past which a decoder's KV cache, computed before, is no longer
        right (longrope switches every layer's rotation there): a generation that crosses it
        runs the whole text again once, as transformers does. None: the cache stays valid."""
        value = self.config.get(LONGROPE_KEY)
        return int(value) if isinstance(value, int | float) else None

    def stop_ids(self) -> set[int]:
        """Token ids that end a generation: the declared end-of-turn ids, else the eos id."""
        eos = self.config.get("eos_token_id")
        return set(self.stop_token_ids) or ({eos} if isinstance(eos, int) else set())

    def provider_stages(self) -> list[StageInfo]:
        return [s for s in self.stages if s.placement == "provider"]
