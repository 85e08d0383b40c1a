"""Fine-tuning through a swarm of real provider processes: LoRA-FA over three stages matches
single-process training step by step, survives a provider's death through erasure-coded
snapshots, fails clearly when too few shards are left, and its adapter changes generation."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.procs import Proc, wait_until
from tests.test_broker.conftest import BrokerProc, add_model, api, wait_joined, wait_ready
from tests.test_client.test_sdk import run_cli

pytestmark = pytest.mark.timeout(300)
Spawner = Callable[..., Any]
MODEL = "tiny-llama-ft"
SETTINGS: dict[str, Any] = {
    "batch": 8,
    "microbatches": 2,
    "seq_len": 16,
    "lr": 0.05,
    "rank": 8,
    "seed": 7,
}


def swarm(
    broker: Spawner, provider: Spawner, package: Path, n: int
) -> tuple[BrokerProc, dict[str, Proc]]:
    b: BrokerProc = broker("--heartbeat-s", "1")
    procs = {}
    for _ in range(n):
        p = provider(b.addr)
        procs[p.wait_for("listening", timeout=60)["peer_id"]] = p
    wait_joined(b.http, procs)
    add_model(b.http, package)
    wait_ready(b.http, MODEL)  # the others join the backup pool; any of them may take over
    return b, procs


def reference(package: Path, steps: int, **settings: Any) -> Any:
    from broker.finetune import FinetuneRequest, LocalFinetune
    from client.data import SAMPLE_DATA, read_texts

    request = FinetuneRequest(model=MODEL, texts=read_texts(SAMPLE_DATA), steps=steps, **settings)
    local = LocalFinetune(package, request)
    return local.run(), local


def events(http: str, job: str) -> list[dict[str, Any]]:
    status, out = api(http, "GET", f"/v1/jobs/{job}/story")
    assert status == 200
    return list(out["events"])


def test_lora_fa_through_three_stages_matches_one_process_and_changes_generation(
    broker: Spawner, provider: Spawner, finetune_package: Path, tmp_path: Path
) -> None:
    from client import BadRequestError, Client
    from client.data import SAMPLE_DATA
    from ir.training import load_state, read_metadata

    b, _ = swarm(broker, provider, finetune_package, 3)
    steps = 16
    expected, local = reference(finetune_package, steps, **SETTINGS)
    seen: list[int] = []
    with Client(b.http, cache_dir=tmp_path / "cache", timeout=60) as fa:
        prompt = "The broker places each stage"
        before = fa.generate(prompt, 12, stream=False, model=MODEL)
        result = fa.finetune(
            MODEL,
            SAMPLE_DATA,
            steps=steps,
            snapshot_every=3,
            progress=lambda s: seen.append(s.step),
            timeout=240,
            **SETTINGS,
        )
        losses = result.losses
        assert seen == list(range(1, steps + 1))
        assert len(losses) == steps
        # the loss drops clearly on the shipped data (a step's batch is random: compare means)
        assert np.mean(losses[-3:]) < 0.9 * np.mean(losses[:3]), losses
        # and every step equals single-process LoRA-FA with the same seed
        for got, want in zip(losses, expected, strict=True):
            assert abs(got - want) <= 1e-3 * abs(want), (losses, expected)

        data = result.adapter.read_bytes()
        meta = read_metadata(data)
        assert meta["model"] == MODEL and meta["method"] == "lora-fa" and meta["rank"] == "8"
        trained = load_state(data)
        want_adapters = local.adapters()
        assert set(trained) == set(want_adapters)
        for name, value in want_adapters.items():
            assert np.allclose(trained[name], value, rtol=1e-3, atol=1e-5), name
        assert any(np.abs(v).max() > 0 for k, v in trained.items() if k.startswith("lora_B"))

        after = fa.generate(prompt, 12, stream=False, model=MODEL, adapter=result.job)
        assert after.tokens != before.tokens
        again = fa.generate(prompt, 12, stream=False, model=MODEL)  # adapters are per session
        assert again.tokens == before.tokens
        assert after.tokens == local_greedy_with(finetune_package, want_adapters, prompt, 12)

        with pytest.raises(BadRequestError) as bad:
            fa.submit({"kind": "finetune", "model": MODEL, "texts": ["a b"], "batch": 3})
        assert bad.value.field == "microbatches"  # 2 microbatches cannot split 3 sequences
        with pytest.raises(BadRequestError, match="one sequence of seq_len 16 needs 17"):
            fa.submit({"kind": "finetune", "model": MODEL, "texts": ["a b"], "seq_len": 16})

    kinds = [e["kind"] for e in events(b.http, result.job)]
    assert "snapshot" in kinds and "adapter_saved" in kinds

    out = tmp_path / "adapter.safetensors"
    cli = json.loads(
        run_cli(
            "finetune", "--model", MODEL, "--steps", "2", "--batch", "4", "--seq-len", "16",
            "--snapshot-every", "0", "--out", str(out), "--json", "--broker", b.http,
            env={"FUSIONAI_CACHE_DIR": str(tmp_path / "cli-cache")},
        )
    )  # fmt: skip
    assert len(cli["losses"]) == 2 and out.is_file() and cli["adapter"] == str(out)
    text = run_cli(
        "generate", "The broker places each stage", "-n", "4", "--model", MODEL,
        "--adapter", str(out), "--broker", b.http, "--json",
        env={"FUSIONAI_CACHE_DIR": str(tmp_path / "cli-cache")},
    )  # fmt: skip
    assert len(json.loads(text)["tokens"]) == 4


def local_greedy_with(package: Path, adapters: dict[str, Any], prompt: str, n: int) -> list[int]:
    from client.stages import ClientStages
    from ir.executors.ort import OrtExecutor
    from ir.package import load_package
    from ir.pipeline import LocalPipeline

    pkg = load_package(package)
    tokens = ClientStages(package).tokenizer.encode(prompt).ids
    per_stage = {
        s.index: {n: adapters[n] for a in s.adapters for n in (a.a_input, a.b_input)}
        for s in pkg.manifest.stages
        if s.adapters
    }
    executors = [OrtExecutor(pkg.models[s.index]) for s in pkg.manifest.stages]
    return LocalPipeline(pkg.manifest, executors, per_stage).generate_greedy(tokens, n)


def submit(fa: Any, steps: int, **settings: Any) -> str:
    from client.data import SAMPLE_DATA, read_texts

    body = {"kind": "finetune", "model": MODEL, "texts": read_texts(SAMPLE_DATA), "steps": steps}
    return str(fa.submit({**body, **SETTINGS, **settings}).id)


def lost_peers(http: str) -> set[str]:
    """Every provider the broker declared lost, with why, for an assertion's message."""
    status, out = api(http, "GET", "/v1/events?limit=10000")
    assert status == 200
    return {e["peer"] for e in out["events"] if e["kind"] == "provider_lost"}


def wait_for_event(http: str, job: str, check: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    def found() -> dict[str, Any] | None:
        return next((e for e in events(http, job) if check(e)), None)

    event: dict[str, Any] = wait_until(f"an event of job {job}", found, timeout=120)
    return event


def test_a_provider_dies_mid_training_and_the_job_resumes_from_the_snapshot(
    broker: Spawner, provider: Spawner, finetune_package: Path, tmp_path: Path
) -> None:
    from client import Client

    b, procs = swarm(broker, provider, finetune_package, 4)  # 3 stages and a backup
    steps = 12
    expected, _ = reference(finetune_package, steps, **SETTINGS)
    with Client(b.http, cache_dir=tmp_path / "cache", timeout=60) as fa:
        job = submit(fa, steps, snapshot_every=3)
        route = wait_for_event(b.http, job, lambda e: e["kind"] == "finetune_started")
        wait_for_event(b.http, job, lambda e: e["kind"] == "snapshot" and e["step"] == 3)
        wait_for_event(b.http, job, lambda e: e["kind"] == "finetune_step" and e["step"] >= 4)
        victim = route["route"][1]
        procs[victim].signal(signal.SIGKILL)
        done = fa.wait(job, timeout=240)
        assert done.state == "succeeded"
        losses = [s.loss for s in fa.finetune_steps(job)]
    story = events(b.http, job)
    assert lost_peers(b.http) == {victim}  # no live provider was declared lost
    recovering = [e for e in story if e["kind"] == "finetune_recovering"]
    assert recovering and recovering[0]["peer"] == victim
    assert recovering[0]["from_step"] >= 3  # from a snapshot, not from the start
    recovered = [e for e in story if e["kind"] == "finetune_recovered"]
    assert recovered and victim not in recovered[-1]["route"]
    # the replayed steps give the uninterrupted run's losses, to the last one
    assert len(losses) == steps
    for got, want in zip(losses, expected, strict=True):
        assert abs(got - want) <= 1e-3 * abs(want), (losses, expected)


def test_fewer_than_k_shards_left_fails_the_job_with_the_reason(
    broker: Spawner, provider: Spawner, finetune_package: Path, tmp_path: Path
) -> None:
    from client import Client, JobFailed

    b, procs = swarm(broker, provider, finetune_package, 5)  # 3 stages, 2 backups
    with Client(b.http, cache_dir=tmp_path / "cache", timeout=60) as fa:
        job = submit(fa, 40, snapshot_every=3, shards=[3, 3])  # every shard is needed
        route = wait_for_event(b.http, job, lambda e: e["kind"] == "finetune_started")
        snap = wait_for_event(b.http, job, lambda e: e["kind"] == "snapshot" and e["step"] == 3)
        owner = route["route"][0]
        holders = snap["holders"]["0"]
        assert owner not in holders and len(holders) == 3
        spare = [h for h in holders if h not in route["route"]] or holders
        for peer in (owner, spare[0]):
            procs[peer].signal(signal.SIGKILL)
        with pytest.raises(JobFailed) as failed:
            fa.wait(job, timeout=240)
    reason = failed.value.job.error or ""
    assert "cannot rebuild" in reason and "2 of the 3 shards needed" in reason, reason
    # the job fails as soon as the rebuild does; a killed backup is declared lost by its
    # silence a little later. No live provider is ever declared lost.
    killed = {owner, spare[0]}
    wait_until("both killed providers declared lost", lambda: lost_peers(b.http) >= killed)
    assert lost_peers(b.http) == killed
