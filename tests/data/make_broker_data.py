"""Write a broker data folder the way a running broker leaves it, for the upgrade test.

    python -m tests.data.make_broker_data tests/data/broker-v1

`tests/data/broker-v1/` was written by this script on main at 3ef63ed (before the rooms
redesign) and is checked in as it came out: a newer broker must open it and find everything in
it (tests/test_broker/test_upgrade.py). Do not regenerate it with newer code; add a new
folder for a new format instead.

What it holds: the broker's identity and artifact secret; two models (a 2-stage tiny BERT
encoder, and a 3-stage tiny Llama with LoRA adapter slots) with their artifacts; their
placements over six providers; a finished embedding job with its results, a cancelled one, and
one the broker stopped before it finished; a finished two-step fine-tune with its snapshot
records and its adapter file; the event log. `expected.json` says what is in it.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

TEXTS = ["a b c", "the quick brown fox", "d e", "jumps over the lazy dog", "f"]


def _packages(root: Path) -> tuple[Path, Path]:
    import torch
    import transformers

    from ir.export import build_package
    from ir.families import AdapterConfig
    from tests.tiny_models import tiny_llama, tiny_tokenizer

    model = tiny_llama()
    tokenizer = root / "tokenizer.json"
    tiny_tokenizer(tokenizer, model.config.vocab_size)
    torch.manual_seed(0)
    bert = transformers.BertModel(
        transformers.BertConfig(
            vocab_size=8192,  # the exporter's example ids go up to 7592
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=128,
        ),
        add_pooling_layer=False,
    ).eval()
    plain, tuned = root / "plain", root / "tuned"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build_package(bert, 2, plain, name="tiny-bert", tokenizer_file=tokenizer)
        build_package(
            model,
            3,
            tuned,
            name="tiny-llama-ft",
            tokenizer_file=tokenizer,
            adapters=AdapterConfig(targets=("q", "k", "v", "o"), rank=4),
        )
    return plain, tuned


async def _write(out: Path, work: Path) -> dict[str, object]:
    from tests.test_broker.inproc import swarm

    plain, tuned = _packages(work)
    s = await swarm(work / "swarm", microbatch=2)
    try:
        for _ in range(6):  # 2 stages and a backup; 3 stages; snapshot holders
            await s.provider()
        model = await s.add_model(plain)
        await s.until("a route", lambda: all(s.broker.serving.route(model) or [[]]))
        done = await s.broker.jobs.submit({"model": model, "texts": TEXTS, "microbatch": 2})
        state = await s.until(
            "the embedding job",
            lambda: (
                (st := s.broker.store.job(done.id).state) not in ("queued", "placed", "running")
                and st
            ),
        )
        assert state == "succeeded", (state, s.broker.store.job(done.id).error)
        results = s.broker.jobs.results(done.id, 0, 100)
        tuned_model = await s.add_model(tuned)
        await s.until("a fine-tune route", lambda: all(s.broker.serving.route(tuned_model) or [[]]))
        body = {
            "kind": "finetune",
            "model": tuned_model,
            "texts": TEXTS * 20,
            "steps": 2,
            "batch": 2,
            "seq_len": 8,
            "snapshot_every": 1,
        }
        ft = await s.broker.jobs.submit(body)
        state = await s.until(
            "the fine-tune",
            lambda: (st := s.broker.store.job(ft.id).state) in ("succeeded", "failed") and st,
            timeout=120,
        )
        assert state == "succeeded", s.broker.store.job(ft.id).error
        cancelled = await s.broker.jobs.submit({"model": model, "texts": TEXTS[:1]})
        s.broker.jobs.cancel(cancelled.id)
        # The broker stops with this job just submitted: it never finished.
        queued = await s.broker.jobs.submit({"model": model, "texts": TEXTS[:2]})
        unfinished = s.broker.store.job(queued.id).state
        expected = {
            "broker_peer": s.broker.peer_id,
            "models": sorted([model, tuned_model]),
            "jobs": {
                done.id: "succeeded",
                ft.id: "succeeded",
                cancelled.id: "cancelled",
                queued.id: unfinished,
            },
            "embedding_job": done.id,
            "embeddings": results["embeddings"],
            "finetune_job": ft.id,
            "finetune_losses": [
                loss for _, losses in s.broker.store.finetune_steps(ft.id) for loss in losses
            ],
            "queued_job": queued.id,
        }
    finally:
        await s.close()
    shutil.copytree(work / "swarm" / "broker", out)
    return expected


def main() -> None:
    out = Path(sys.argv[1]).resolve()
    if out.exists():
        raise SystemExit(f"{out} exists: this script writes a new folder")
    with tempfile.TemporaryDirectory() as work:
        expected = asyncio.run(_write(out, Path(work)))
    (out / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    print(f"wrote {out}: {sum(f.stat().st_size for f in out.rglob('*') if f.is_file())} bytes")


if __name__ == "__main__":
    main()
