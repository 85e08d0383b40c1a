"""A GGUF file's tokenizer as a `tokenizers` JSON file, which the package ships.

Byte-level BPE vocabularies (`tokenizer.ggml.model = "gpt2"`: Llama 3, Qwen, Mistral Nemo, ...)
are rebuilt here from the file's tokens, merges, token types and pre-tokenizer name, with the
split patterns llama.cpp uses for each (`src/llama-vocab.cpp`). SentencePiece vocabularies
(`"llama"`: Gemma, Phi-3, Mistral 7B v0.1) go through transformers' GGUF tokenizer converter,
which rebuilds their merges from the scores.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ir.gguf.reader import GGUFError, GGUFModel

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types
# the split pattern before byte-level BPE, by `tokenizer.ggml.pre`; any other name: GPT-2's
LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLITS = {
    "llama3": LLAMA3,
    "llama-v3": LLAMA3,
    "llama-bpe": LLAMA3,
    "smaug-bpe": LLAMA3,
    "qwen2": QWEN2,
    "deepseek-r1-qwen": QWEN2,
}


def tokenizer_json(g: GGUFModel) -> str | None:
    """The tokenizer the file describes, serialized; None if it holds none."""
    kind = g.meta.get("tokenizer.ggml.model")
    if kind is None or not g.meta.get("tokenizer.ggml.tokens"):
        return None
    if kind == "gpt2":
        return str(_byte_level(g).to_str())
    if kind == "llama":
        return _sentencepiece(g.files[0])
    raise GGUFError(f"tokenizer model {kind!r} is not supported; supported: gpt2 (BPE), llama")


def _byte_level(g: GGUFModel) -> Any:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.processors import TemplateProcessing

    tokens: list[str] = list(g.meta["tokenizer.ggml.tokens"])
    types: list[int] = list(g.meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in g.meta.get("tokenizer.ggml.merges") or []]
    if len(types) != len(tokens) or any(len(m) != 2 for m in merges):
        raise GGUFError("the file's tokenizer is malformed (token types or merges)")
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    split = SPLITS.get(str(g.meta.get("tokenizer.ggml.pre", "")))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [
            AddedToken(t, normalized=False, special=True)
            for t, k in zip(tokens, types, strict=True)
            if k == CONTROL
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == USER_DEFINED
        ]
    )
    bos = g.meta.get("tokenizer.ggml.bos_token_id")
    if g.meta.get("tokenizer.ggml.add_bos_token") and isinstance(bos, int) and bos < len(tokens):
        tok.post_processor = TemplateProcessing(
            single=f"{tokens[bos]} $A",
            pair=f"{tokens[bos]} $A $B",
            special_tokens=[(tokens[bos], bos)],
        )
    return tok


def _sentencepiece(first: Path) -> str:
    import transformers

    try:
        tok = transformers.AutoTokenizer.from_pretrained(first.parent, gguf_file=first.name)
    except (ValueError, KeyError, OSError) as exc:
        raise GGUFError(f"cannot rebuild the file's SentencePiece tokenizer: {exc}") from None
    return str(tok.backend_tokenizer.to_str())
