"""The client's share of a model: tokenizer, embedding stage and output head, run locally.

A model package marks its first and last stages `placement="client"`: the token embedding and
the head (pooling for encoders, the LM head for decoders). The client runs them itself, so no
token ids or text travel to providers; only hidden states do. The broker uses this same code for
the client-side parts of batch jobs it runs for HTTP users.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ir.errors import IRError
from ir.executors.ort import OrtExecutor
from ir.manifest import ModelManifest, StageInfo
from ir.package import load_package

Array = np.ndarray[Any, Any]


DEFAULT_MAX_TOKENS = 512  # longest input sequence the client stages take by default; tokens
CHARS_PER_TOKEN = 32  # texts are cut at this many characters per token before tokenizing


class ClientStageError(ValueError):
    """The input cannot be run through this model's client stages; the message says why."""


class ClientStages:
    """A package's client-side stages (validated ONNX) and its tokenizer, if it ships one."""

    def __init__(self, directory: Path, *, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        manifest = ModelManifest.from_json((directory / "manifest.json").read_bytes())
        client = [s.index for s in manifest.stages if s.placement == "client"]
        package = load_package(directory, stages=client)
        self.manifest = manifest
        self.max_tokens = max_tokens  # longest input sequence accepted; tokens
        self.first: StageInfo = manifest.stages[0]
        self.last: StageInfo = manifest.stages[-1]
        if self.first.placement != "client" or self.last.placement != "client":
            raise IRError(
                f"{manifest.name}: the first and last stages must run on the client "
                f"(embedding and head)"
            )
        self.executors = {
            i: OrtExecutor(
                package.models[i],
                inputs=list(manifest.stages[i].inputs),
                outputs=list(manifest.stages[i].outputs),
                spinning=False,  # runs between network waits: idle threads would burn the
            )  # cores the providers beside it (or the user's other work) need
            for i in client
        }
        self.decoder = any(
            i.name.startswith("past_") for s in manifest.stages for i in s.inputs
        )  # keeps a KV cache: generates text
        eos = manifest.config.get("eos_token_id")
        self.eos: int | None = eos if isinstance(eos, int) else None
        self.stops: frozenset[int] = frozenset(manifest.stop_ids())  # every end-of-turn id
        self.tokenizer: Any = None
        if manifest.tokenizer is not None:
            try:
                from tokenizers import Tokenizer
            except ImportError:  # texts are refused with a clear message; token ids still work
                self.tokenizer = None
            else:
                self.tokenizer = Tokenizer.from_file(str(directory / manifest.tokenizer))

    def tokenize(self, texts: Sequence[str]) -> tuple[Array, Array]:
        """(input_ids, attention_mask), padded to the longest text, cut at `max_tokens`.

        A text is first cut at `CHARS_PER_TOKEN` characters per token it may keep, so the
        tokenizer's work is bounded by the cut, not by the text: only a text whose first
        `max_tokens` tokens average more than that many characters each (words hundreds of
        characters long) is read shorter than the tokenizer alone would read it."""
        if self.tokenizer is None:
            why = (
                "it ships no tokenizer"
                if self.manifest.tokenizer is None
                else "the `tokenizers` package is not installed here"
            )
            raise ClientStageError(
                f"model {self.manifest.name} cannot take texts: {why}; send token ids instead"
            )
        chars = self.max_tokens * CHARS_PER_TOKEN
        encodings = self.tokenizer.encode_batch([t[:chars] for t in texts])
        ids = [e.ids[: self.max_tokens] for e in encodings]
        return self.pad(ids)

    def pad(self, token_ids: Sequence[Sequence[int]]) -> tuple[Array, Array]:
        """Pad sequences of token ids with 0 to one length; the mask marks real tokens."""
        if not token_ids:
            raise ClientStageError("no sequences to run")
        vocab = int(self.manifest.config.get("vocab_size", 0) or 0)
        longest = max(len(t) for t in token_ids)
        if longest == 0:
            raise ClientStageError("every sequence is empty")
        if longest > self.max_tokens:
            raise ClientStageError(
                f"a sequence has {longest} tokens; at most {self.max_tokens} are accepted"
            )
        ids = np.zeros((len(token_ids), longest), dtype=np.int64)
        mask = np.zeros((len(token_ids), longest), dtype=np.int64)
        for row, seq in enumerate(token_ids):
            if vocab and any(not 0 <= int(t) < vocab for t in seq):
                raise ClientStageError(f"sequence {row} has token ids outside 0..{vocab - 1}")
            ids[row, : len(seq)] = seq
            mask[row, : len(seq)] = 1
        return ids, mask

    def embed(self, input_ids: Array, positions: Array | None = None) -> Array:
        """The first stage: token ids (and their positions, for models that take them; by
        default 0, 1, ...) to hidden states."""
        feeds = {"input_ids": input_ids}
        if any(i.name == "position_ids" for i in self.first.inputs):
            if positions is None:
                positions = np.arange(input_ids.shape[1], dtype=np.int64)[None, :]
            feeds["position_ids"] = np.broadcast_to(positions, input_ids.shape).copy()
        out = self.executors[self.first.index].run(feeds)
        hidden: Array = out["hidden_states"]
        return hidden

    def head(self, hidden: Array, attention_mask: Array) -> Array:
        """The last stage: pooled, normalized sentence embeddings for an encoder, logits for a
        decoder."""
        names = {i.name for i in self.last.inputs}
        dtype = next((i.dtype for i in self.last.inputs if i.name == "hidden_states"), "float32")
        feeds: dict[str, Array] = {"hidden_states": hidden.astype(dtype, copy=False)}
        if "attention_mask" in names:
            feeds["attention_mask"] = attention_mask
        out = self.executors[self.last.index].run(feeds)
        result: Array = out[self.last.outputs[0].name]
        return result
