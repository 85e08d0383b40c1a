"""Run a package's stages in order on one machine: encoders and greedy decoding.

This is the reference path (tests, benchmarks, `fusionai ir` checks); across the swarm the
same stages run on different providers, chained by the client.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ir.errors import ExecutorError
from ir.executors.base import Executor
from ir.manifest import ModelManifest, StageInfo

Array = np.ndarray[Any, Any]


def zero_adapters(stage: StageInfo, rank: int = 1, dtype: str = "float32") -> dict[str, Array]:
    """Adapter inputs that leave the stage equal to its base model."""
    feeds: dict[str, Array] = {}
    for a in stage.adapters:
        feeds[a.a_input] = np.zeros((rank, a.in_features), dtype=dtype)
        feeds[a.b_input] = np.zeros((a.out_features, rank), dtype=dtype)
    return feeds


KEY_MASK = "attention_mask"  # decoder stages: which of the past + new keys hold a token


def batchable(stage: StageInfo) -> bool:
    """Whether a decoder stage takes `attention_mask` over its KV cache, so that sessions of
    different lengths can run as one batch with their caches padded (packages split before
    it existed run their sessions one at a time)."""
    names = {i.name for i in stage.inputs}
    return KEY_MASK in names and any(n.startswith("past_") for n in names)


def key_mask(stage: StageInfo, batch: int, total: int) -> dict[str, Array]:
    """A decoder stage's `attention_mask` for `batch` unpadded rows of `total` tokens (cached
    plus new), if it takes one."""
    if not batchable(stage):
        return {}
    return {KEY_MASK: cache_mask([0] * batch, 0, total)}


NEW_KV = "new_"  # a decoder stage's outputs of its new tokens' keys and values: `new_key.N`
PRESENT_KV = "present_"  # those of packages split before: the whole cache again, `present_key.N`
CACHE_OUTPUTS = (NEW_KV, PRESENT_KV)  # (prefixes: what a session's answer leaves out)
KV_ROOM = 32  # a grown cache has room for this many more tokens at least (or an eighth more)


def appends(stage: StageInfo) -> bool:
    """Whether a decoder stage outputs only its new tokens' keys and values (`new_*`), which
    the caller writes into its cache (`next_cache`); packages split before output the whole
    cache again (`present_*`: a copy of it every step)."""
    return any(o.name.startswith(NEW_KV) for o in stage.outputs)


def room(tokens: int) -> int:
    """The width a cache is given when it must grow to hold `tokens`: room for `KV_ROOM` more
    tokens, or an eighth more, whichever is more (a copy every 32 tokens at most)."""
    return tokens + max(KV_ROOM, tokens // 8)


def cache_mask(lengths: Sequence[int], width: int, new: int) -> Array:
    """`attention_mask` for rows holding `lengths[i]` tokens at the start of a cache `width`
    long (padding after them), and `new` tokens each after it."""
    mask = np.ones((len(lengths), width + new), dtype=np.int64)
    mask[:, :width] = np.arange(width) < np.asarray(lengths)[:, None]
    return mask


def cache_feeds(
    stage: StageInfo, cache: Mapping[str, Array], lengths: Sequence[int], new: int
) -> dict[str, Array]:
    """A decoder stage's cache inputs and, if it takes one, its mask: row i of `cache`
    (past_* -> (rows, kv heads, width, head_dim)) holds `lengths[i]` tokens, then padding."""
    feeds = dict(cache)
    if batchable(stage):
        width = next(iter(cache.values())).shape[2] if cache else 0
        feeds[KEY_MASK] = cache_mask(lengths, width, new)
    return feeds


def next_cache(
    cache: Mapping[str, Array], lengths: Sequence[int], outputs: Mapping[str, Array]
) -> tuple[dict[str, Array], int] | None:
    """The cache after a step, and the tokens its longest row then holds (None: `outputs`
    has no cache). A stage's `new_*` outputs are written after each row's `lengths[i]`
    tokens: in place where the arrays have room (nothing before a row's end changes, so a
    step refused after this leaves its cache as it was), else into grown copies. An older
    stage's `present_*` outputs are the whole new cache, unpadded."""
    present = _renamed(outputs, PRESENT_KV)
    if present:
        return present, int(next(iter(present.values())).shape[2])
    new = _renamed(outputs, NEW_KV)
    if not new:
        return None
    count = int(next(iter(new.values())).shape[2])
    need = max(lengths) + count
    grown: dict[str, Array] = {}
    for name, tokens in new.items():
        old = cache[name]
        if old.shape[2] < need or not old.flags.writeable:
            rows, heads, _, dim = tokens.shape  # (an empty cache may be given as one row)
            array = np.zeros((rows, heads, room(need), dim), dtype=old.dtype)
            if need > count:
                array[:, :, : need - count] = old[:, :, : need - count]
            old = array
        if min(lengths) == need - count:  # every row as long: one copy for them all
            old[:, :, need - count : need] = tokens
        elif count == 1:  # a batch's step: each row's token after its own, in one write
            old[np.arange(len(lengths)), :, np.asarray(lengths)] = tokens[:, :, 0]
        else:
            for row, n in enumerate(lengths):
                old[row, :, n : n + count] = tokens[row]
        grown[name] = old
    return grown, need


def _renamed(outputs: Mapping[str, Array], prefix: str) -> dict[str, Array]:
    """The outputs named `prefix`..., under their cache inputs' names (`past_`...)."""
    return {"past_" + k.removeprefix(prefix): v for k, v in outputs.items() if k.startswith(prefix)}


class LocalPipeline:
    """A package's stages, each with an executor, run in order.

    `hop` is what the wire does to hidden states between two stages: a package whose wire is
    not "native" needs it (`p2p.tensor.through_wire` with the manifest's wire), so that a run
    here computes what the swarm computes.
    """

    def __init__(
        self,
        manifest: ModelManifest,
        executors: Sequence[Executor],
        adapters: Mapping[int, Mapping[str, Array]] | None = None,
        hop: Callable[[Array], Array] | None = None,
    ) -> None:
        if hop is None and manifest.wire != "native":
            raise ExecutorError(
                f"{manifest.name} sends hidden states as {manifest.wire}: give the pipeline "
                "that wire's hop"
            )
        if len(executors) != len(manifest.stages):
            raise ExecutorError(f"{len(manifest.stages)} stages need as many executors")
        self.hop: Callable[[Array], Array] = hop or (lambda hidden: hidden)
        self.manifest = manifest
        self.executors = list(executors)
        self.adapters = {
            s.index: dict(adapters[s.index])
            if adapters and s.index in adapters
            else zero_adapters(s)
            for s in manifest.stages
            if s.adapters
        }

    def _middle(self) -> list[tuple[StageInfo, Executor]]:
        return [(s, e) for s, e in zip(self.manifest.stages, self.executors, strict=True)][1:-1]

    def encode(self, input_ids: Array, attention_mask: Array) -> Array:
        """Sentence embeddings from an encoder package (client embed, blocks, client pooling)."""
        hidden = self.executors[0].run({"input_ids": input_ids})["hidden_states"]
        for stage, executor in self._middle():
            feeds = {"hidden_states": self.hop(hidden), "attention_mask": attention_mask}
            feeds.update(self.adapters.get(stage.index, {}))
            hidden = executor.run(feeds)["hidden_states_out"]
        last = {"hidden_states": self.hop(hidden), "attention_mask": attention_mask}
        return self.executors[-1].run(last)["embeddings"]

    def run_chain(self, feeds: Mapping[str, Array]) -> dict[str, Array]:
        """Run every stage in order, each taking what it needs from the graph inputs and
        earlier outputs (for bring-your-own-ONNX splits); returns the last stage's outputs."""
        pool = dict(feeds)
        out: dict[str, Array] = {}
        for stage, executor in zip(self.manifest.stages, self.executors, strict=True):
            out = executor.run({i.name: pool[i.name] for i in stage.inputs})
            pool.update(out)
        return out

    def new_cache(self, batch: int = 1) -> dict[int, dict[str, Array]]:
        cfg = self.manifest.config
        kv, head_dim = int(cfg["num_kv_heads"]), int(cfg["head_dim"])
        cache: dict[int, dict[str, Array]] = {}
        for stage, _ in self._middle():
            cache[stage.index] = {
                i.name: np.zeros((batch, kv, 0, head_dim), dtype=i.dtype)
                for i in stage.inputs
                if i.name.startswith("past_")
            }
        return cache

    def step(self, input_ids: Array, past_len: int, cache: dict[int, dict[str, Array]]) -> Array:
        """Run `input_ids` (batch, seq) after `past_len` cached tokens; returns logits and
        updates `cache` in place."""
        seq = input_ids.shape[1]
        positions = np.arange(past_len, past_len + seq, dtype=np.int64)[None, :].repeat(
            input_ids.shape[0], 0
        )
        embed = self.executors[0]
        feeds: dict[str, Array] = {"input_ids": input_ids}
        if any(i.name == "position_ids" for i in embed.inputs):
            feeds["position_ids"] = positions
        hidden = embed.run(feeds)["hidden_states"]
        for stage, executor in self._middle():
            lengths = [past_len] * input_ids.shape[0]
            feeds = {"hidden_states": self.hop(hidden)}
            feeds.update(cache_feeds(stage, cache[stage.index], lengths, seq))
            if any(i.name == "position_ids" for i in stage.inputs):
                feeds["position_ids"] = positions
            feeds.update(self.adapters.get(stage.index, {}))
            out = executor.run(feeds)
            hidden = out["hidden_states_out"]
            kept = next_cache(cache[stage.index], lengths, out)
            if kept is not None:
                cache[stage.index] = kept[0]
        head = self.manifest.stages[-1]
        dtype = next((i.dtype for i in head.inputs if i.name == "hidden_states"), "float32")
        hidden = self.hop(hidden).astype(dtype, copy=False)
        logits: Array = self.executors[-1].run({"hidden_states": hidden})["logits"]
        return logits

    def generate_greedy(
        self, prompt: Sequence[int], max_new_tokens: int, *, use_cache: bool = True
    ) -> list[int]:
        """Greedy decoding. With the cache each step feeds one token; without, the whole text."""
        tokens = list(prompt)
        cache = self.new_cache()
        fed = 0
        restart = self.manifest.cache_valid_until()
        for _ in range(max_new_tokens):
            if restart is not None and 0 < fed <= restart < len(tokens):
                cache, fed = self.new_cache(), 0  # the cache so far is computed the old way
            if use_cache:
                ids = np.array([tokens[fed:]], dtype=np.int64)
                logits = self.step(ids, fed, cache)
                fed = len(tokens)
            else:
                logits = self.step(np.array([tokens], dtype=np.int64), 0, self.new_cache())
            tokens.append(int(np.argmax(logits[0, -1])))
        return tokens[len(prompt) :]
