"""Pre-training from scratch on the shipped corpus, in one process: a tokenizer and a random
Llama as a trainable package, K replicas matching one process step for step, learning, DiLoCo,
and the trained weights as a package that generates."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ir.scratch import CONFIGS, SHIPPED_DATA, Corpus, CorpusError, read_texts
from ir.scratch import tokenize as tokenize_texts
from provider.localtrain import LocalRun, TrainSettings
from tests.tiny_models import tokenizer_of

pytestmark = pytest.mark.timeout(120)
SEQ = 64


@pytest.fixture(scope="module")
def tiny(pretrain_package: Path) -> tuple[Path, Corpus]:
    """The tiny config with a tokenizer trained on the shipped corpus; the corpus in rows."""
    texts = read_texts(SHIPPED_DATA)
    tokens = tokenize_texts(texts, tokenizer_of(pretrain_package))
    return pretrain_package, Corpus(tokens, SEQ)


def test_the_shipped_corpus_is_real_text_with_its_licence() -> None:
    texts = read_texts(SHIPPED_DATA)
    assert len(texts) == 79 and sum(map(len, texts)) > 400_000
    assert any("assert" in t and "AssertionError" in t for t in texts)
    notes = (SHIPPED_DATA.parent / "README.md").read_text()
    assert "Python Software Foundation License" in notes and "pydoc_data" in notes


def test_a_trainable_export_keeps_every_weight_its_own(tiny: tuple[Path, Corpus]) -> None:
    """A fresh model's norm weights are all ones: a plain export would merge them into one
    initializer. The trainable package has as many trainable values as the model."""
    import transformers

    from ir.pretrain import Replica

    package, _ = tiny
    fields = dict(CONFIGS["llama-tiny"], tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields))
    replica = Replica(package)
    assert replica.parameters == sum(p.numel() for p in model.parameters())
    norms = [n for n in replica.params if "layernorm" in n or "norm.weight" in n]
    assert len(norms) == 2 * fields["num_hidden_layers"] + 1, norms


@pytest.mark.parametrize("replicas", [2, 3])
def test_replicas_give_the_losses_of_one_process(tiny: tuple[Path, Corpus], replicas: int) -> None:
    """Uncompressed, K replicas (each a shard of the same global batches, summed by a ring
    all-reduce) give one process's per-step losses within 1e-5 relative, for 20 steps, and
    end with identical weights."""
    package, corpus = tiny
    settings = TrainSettings(steps=20, batch=12, seq_len=SEQ)
    one = [r.loss for r in LocalRun(package, corpus, 1, settings).run()]
    run = LocalRun(package, corpus, replicas, settings)
    many = [r.loss for r in run.run()]
    np.testing.assert_allclose(many, one, rtol=1e-5)
    assert one[-1] < one[0]
    assert run.identical()
    sent = run.records[-1].bytes_sent
    payload = run.records[-1].payload_bytes
    assert payload == 4 * run.replicas[0].parameters
    assert sent == pytest.approx(2 * (replicas - 1) / replicas * payload, rel=0.01)


@pytest.mark.slow  # (7 s: the suite runs near its budget)
def test_uncompressed_training_learns_and_the_result_generates(
    tiny: tuple[Path, Corpus], tmp_path: Path
) -> None:
    """200 steps: the loss falls to at most 0.75 of step 0's, the held-out loss falls too, and
    the trained weights saved as a package generate what the replica computes."""
    from ir.executors.ort import OrtExecutor
    from ir.package import load_package
    from ir.pipeline import LocalPipeline

    package, corpus = tiny
    run = LocalRun(package, corpus, 1, TrainSettings(steps=200, batch=12, seq_len=SEQ))
    before = run.validation_loss()
    losses = [r.loss for r in run.run()]
    assert losses[-1] <= 0.75 * losses[0], (losses[0], losses[-1])
    assert run.validation_loss() < 0.8 * before
    saved = run.replicas[0].save(tmp_path / "trained", "tiny-trained")
    loaded = load_package(saved)
    assert json.loads((saved / "manifest.json").read_text())["name"] == "tiny-trained"
    pipe = LocalPipeline(
        loaded.manifest, [OrtExecutor(loaded.models[s.index]) for s in loaded.manifest.stages]
    )
    rows = corpus.val[:2, :SEQ]
    logits = pipe.step(rows, 0, pipe.new_cache())
    import torch

    with torch.no_grad():
        want = run.replicas[0]._logits(torch.from_numpy(rows)).numpy()
    np.testing.assert_allclose(logits, want, rtol=1e-3, atol=1e-3)


def test_diloco_keeps_replicas_identical_at_each_outer_step(tiny: tuple[Path, Corpus]) -> None:
    package, corpus = tiny
    settings = TrainSettings(steps=10, batch=12, seq_len=SEQ, outer_every=5)
    run = LocalRun(package, corpus, 2, settings)
    records = run.run(steps=4)
    assert not run.identical()  # local steps on different shards
    assert all(r.bytes_sent == 0 for r in records)
    records = run.run(steps=1)  # the fifth: an outer step
    assert run.identical() and records[0].bytes_sent > 0
    assert records[0].loss < run.records[0].loss


def test_bad_requests_are_refused_before_anything_runs(
    tiny: tuple[Path, Corpus], tmp_path: Path
) -> None:
    from ir.compress import CompressionError
    from ir.pretrain import PretrainError

    package, corpus = tiny
    with pytest.raises(CorpusError, match="cannot read"):
        read_texts(tmp_path / "missing.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n[1, 2]\n')
    with pytest.raises(CorpusError, match=r"bad\.jsonl:2"):
        read_texts(tmp_path / "bad.jsonl")
    with pytest.raises(CorpusError, match="more data or a shorter seq_len"):
        Corpus(np.arange(100, dtype=np.int64), 64)
    with pytest.raises(CompressionError, match="unknown compressor"):
        LocalRun(package, corpus, 2, TrainSettings(steps=1, compress="zip"))
    with pytest.raises(CompressionError, match="rank must be"):
        LocalRun(package, corpus, 2, TrainSettings(steps=1, compress="acp", rank=0))
    with pytest.raises(PretrainError, match="cannot be shared by 13"):
        LocalRun(package, corpus, 13, TrainSettings(steps=1, batch=12))
