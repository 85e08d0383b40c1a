"""Stage training on its own: LoRA-FA keeps less for backward than LoRA, updates wait for
every microbatch, and a trainer rebuilt from its saved state goes on exactly as the original."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")


def request(**extra: Any) -> Any:
    from broker.finetune import FinetuneRequest
    from client.data import SAMPLE_DATA, read_texts

    settings = {"batch": 4, "microbatches": 2, "seq_len": 16, "rank": 4, "lr": 0.05, "seed": 3}
    return FinetuneRequest(
        model="tiny-llama-ft", texts=read_texts(SAMPLE_DATA), **{**settings, **extra}
    )


def saved_bytes(local: Any) -> int:
    from ir.training import saved_bytes as count

    ids, _ = local.data.microbatch(1, 0)
    positions = np.broadcast_to(np.arange(ids.shape[1]), ids.shape).copy()
    inputs = {"hidden_states": local.client.embed(ids), "position_ids": positions}
    return int(count(local.trainers[0], 1, 0, inputs))


def test_lora_fa_saves_less_for_backward_and_trains_only_b(finetune_package: Path) -> None:
    from broker.finetune import LocalFinetune

    fa = LocalFinetune(finetune_package, request(method="lora-fa"))
    lora = LocalFinetune(finetune_package, request(method="lora"))
    assert saved_bytes(lora) > saved_bytes(fa)
    assert all(n.startswith("lora_B.") for n in fa.trainers[0].trainable)
    assert {n.split(".")[0] for n in lora.trainers[0].trainable} == {"lora_A", "lora_B"}
    before = fa.adapters()
    fa.run(2)
    after = fa.adapters()
    for name in before:
        moved = not np.array_equal(before[name], after[name])
        assert moved == name.startswith("lora_B."), name  # A stays frozen


def test_update_waits_for_every_microbatch_and_steps_in_order(finetune_package: Path) -> None:
    from broker.finetune import LocalFinetune
    from ir.training import TrainingError

    local = LocalFinetune(finetune_package, request())
    trainer = local.trainers[-1]
    ids, _ = local.data.microbatch(1, 0)
    hidden = local.trainers[0].forward(
        1, 0, {"hidden_states": local.client.embed(ids), "position_ids": np.zeros_like(ids)}
    )
    with pytest.raises(TrainingError, match="forward of step 2"):
        trainer.forward(2, 0, {"hidden_states": hidden, "position_ids": np.zeros_like(ids)})
    out = trainer.forward(1, 0, {"hidden_states": hidden, "position_ids": np.zeros_like(ids)})
    trainer.backward(1, 0, np.ones_like(out), input_grad=True)
    with pytest.raises(TrainingError, match=r"microbatches \[1\] are missing"):
        trainer.update(1)
    with pytest.raises(TrainingError, match="no forward of step 1 microbatch 0"):
        trainer.backward(1, 0, np.ones_like(out), input_grad=False)


def test_a_trainer_rebuilt_from_its_state_goes_on_identically(finetune_package: Path) -> None:
    from broker.finetune import LocalFinetune
    from ir.training import load_state, save_state

    a = LocalFinetune(finetune_package, request())
    b = LocalFinetune(finetune_package, request())
    a.run(3)
    b.run(1)  # b has moved elsewhere; then takes a's state, as a replacement provider would
    for ta, tb in zip(a.trainers, b.trainers, strict=True):
        tb.load_state(load_state(save_state(ta.state())))
    assert a.run(2) == b.run(2)


def test_erasure_code_rebuilds_from_any_k_of_n_and_no_fewer() -> None:
    import itertools

    from provider.shards import ShardError, decode, encode

    data = np.random.default_rng(0).bytes(10_001)
    shards = encode(data, 3, 5)
    assert len(shards) == 5 and sum(map(len, shards)) < 2 * len(data)  # not 5 copies
    for chosen in itertools.combinations(range(5), 3):
        assert decode({i: shards[i] for i in chosen}, 3, 5, len(data)) == data
    with pytest.raises(ShardError, match="2 of the 3 shards needed"):
        decode({0: shards[0], 4: shards[4]}, 3, 5, len(data))
