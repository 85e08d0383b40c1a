"""A model package to pre-train from scratch: a shipped config, a tokenizer trained on the
data, random weights, and a trainable export (each weight its own initializer).

The shipped corpus is `ir/data/python-reference.jsonl` (real text: the Python reference's help
topics; its source and licence in `ir/data/README.md`); the shipped configs are
Llama decoders. `llama-14m` (6 blocks at hidden 384, 13.8 M parameters) is the one to train;
`llama-tiny` (2 blocks at hidden 64) is what tests train in seconds.
"""

from __future__ import annotations

import json
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ir.errors import IRError
from ir.manifest import ModelManifest
from ir.training import pack, step_rows

Array = np.ndarray[Any, Any]
EOS = "<|endoftext|>"
SHIPPED_DATA = Path(__file__).resolve().parent / "data" / "python-reference.jsonl"
# Llama configs (transformers.LlamaConfig fields); the tokenizer's size is the vocabulary.
CONFIGS: dict[str, dict[str, Any]] = {
    "llama-14m": dict(
        num_hidden_layers=6,
        hidden_size=384,
        num_attention_heads=6,
        num_key_value_heads=6,
        intermediate_size=1024,
        max_position_embeddings=512,
        vocab_size=4096,
    ),
    "llama-tiny": dict(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=256,
        vocab_size=512,
    ),
}


class CorpusError(IRError):
    """The training data cannot be used; the message says why."""


def read_config(name_or_path: str) -> dict[str, Any]:
    """A shipped config by name, or a JSON file of LlamaConfig fields."""
    if name_or_path in CONFIGS:
        return dict(CONFIGS[name_or_path])
    path = Path(name_or_path)
    if not path.is_file():
        raise CorpusError(f"no config {name_or_path!r}: use one of {list(CONFIGS)} or a JSON file")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CorpusError(f"{path}: not a JSON config ({exc})") from None
    if not isinstance(config, dict) or "hidden_size" not in config:
        raise CorpusError(f"{path}: a JSON object of LlamaConfig fields (hidden_size, ...)")
    return config


def read_texts(path: Path) -> list[str]:
    """Training texts: a JSON-lines file's "text" fields (`.jsonl`), else the whole file as one
    text. UTF-8."""
    try:
        raw = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise CorpusError(f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise CorpusError(f"{path} is not UTF-8 text") from None
    if Path(path).suffix != ".jsonl":
        return [raw] if raw.strip() else []
    texts = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise CorpusError(f"{path}:{n}: not JSON ({exc})") from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise CorpusError(f'{path}:{n}: each line needs a "text" string')
        texts.append(row["text"])
    return texts


def train_tokenizer(texts: list[str], path: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer with `vocab_size` entries, EOS at id 0, trained on `texts`
    (deterministic), written as a tokenizers JSON file."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))


def init_package(
    out: Path,
    texts: list[str],
    *,
    config: dict[str, Any],
    stages: int = 2,
    seed: int = 0,
    name: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> ModelManifest:
    """A randomly initialised Llama of `config` with a tokenizer trained on `texts`, as a
    trainable package at `out` (`stages` provider stages)."""
    import torch
    import transformers

    from ir.export import build_package

    if not texts:
        raise CorpusError("no texts to train a tokenizer on")
    vocab = int(config.get("vocab_size", 4096))
    fields = dict(config, vocab_size=vocab, tie_word_embeddings=False, bos_token_id=0)
    fields.update(eos_token_id=0, attention_dropout=0.0)
    with tempfile.TemporaryDirectory() as tmp:
        tok_file = Path(tmp) / "tokenizer.json"
        train_tokenizer(texts, tok_file, vocab)
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields)).eval()
        if progress:
            params = sum(p.numel() for p in model.parameters())
            progress(f"a {params / 1e6:.1f} M-parameter Llama, tokenizer of {vocab} tokens")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return build_package(
                model,
                stages,
                out,
                name=name or out.name,
                tokenizer_file=tok_file,
                progress=progress,
                trainable=True,
            )


def tokenize(texts: list[str], tokenizer_file: Path) -> Array:
    """The texts' token ids end to end, each followed by EOS (id 0)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for encoding in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(encoding.ids)
        if eos is not None:
            ids.append(eos)
    return np.array(ids, dtype=np.int64)


class Corpus:
    """Token rows of `seq_len + 1` cut from the data; the last `holdout` of them held out for
    validation. Step `s`'s global batch depends on (seed, s) alone."""

    def __init__(self, tokens: Array, seq_len: int, *, holdout: float = 0.05, seed: int = 0):
        if seq_len < 2:
            raise CorpusError(f"seq_len must be at least 2 (it was {seq_len})")
        blocks = pack([tokens.tolist()], seq_len)
        if len(blocks) < 4:
            raise CorpusError(
                f"the data makes {len(blocks)} sequences of {seq_len + 1} tokens; "
                f"use more data or a shorter seq_len"
            )
        held = max(1, round(len(blocks) * holdout))
        self.train, self.val = blocks[:-held], blocks[-held:]
        self.seq_len, self.seed = seq_len, seed

    @property
    def tokens(self) -> int:
        return int(self.train.size)

    def batch(self, step: int, size: int) -> Array:
        rows: Array = self.train[step_rows(len(self.train), step, size, self.seed)]
        return rows
