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
