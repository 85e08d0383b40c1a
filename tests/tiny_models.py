"""Small random models shared by the test packages (built with a fixed seed)."""

from __future__ import annotations

from typing import Any


def tiny_llama() -> Any:
    """A 4-block Llama (hidden 128, grouped-query attention) with random weights."""
    import torch
    import transformers

    torch.manual_seed(2)
    config = transformers.LlamaConfig(
        num_hidden_layers=4,
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        vocab_size=512,
        max_position_embeddings=512,
        initializer_range=0.1,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.LlamaForCausalLM(config).eval()


CORPUS = [
    "The swarm runs each stage on a gaming PC and sends hidden states to the next one.",
    "A broker keeps a pool of providers; a backup takes over when one quits.",
    "Models travel as ONNX, so one job can span machines with different GPUs.",
    "Hello world! Generation streams tokens one at a time through the pipeline.",
]


def tiny_tokenizer(path: Any, vocab_size: int = 512) -> None:
    """A byte-level BPE tokenizer with `vocab_size` entries, "<|endoftext|>" at id 0, trained
    on a few sentences (deterministic), written as a tokenizers JSON file at `path`."""
    from cli.demo_models import bpe_tokenizer

    bpe_tokenizer(CORPUS, path, vocab_size)
