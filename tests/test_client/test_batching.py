"""Sixteen SDK generations at once through a swarm of real provider processes: the providers
run their steps in shared runs, each generation gets its tokens alone, and a provider killed
mid-way is failed over by every session it served."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.procs import Proc, wait_until
from tests.test_broker.conftest import BrokerProc, add_model, wait_joined, wait_ready
from tests.tiny_models import greedy_with_gaps, same_as_alone

pytestmark = pytest.mark.timeout(240)
Spawner = Callable[..., Any]
SESSIONS, NEW_TOKENS = 16, 16


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [[int(t) for t in rng.integers(1, 512, size=2 + i % 7)] for i in range(SESSIONS)]


async def _swarm_run(
    broker: Spawner, provider: Spawner, package: Path, tmp_path: Path, kill: bool
) -> tuple[dict[str, Proc], list[Any], list[dict[str, Any]]]:
    """16 greedy generations at once through a 3-stage model on 4 providers (a backup among
    them); with `kill`, the provider serving the middle stage is killed once every session
    has streamed a few tokens. Returns (providers, generations, the stage route)."""
    from client import AsyncClient

    b: BrokerProc = broker()
    procs: dict[str, Proc] = {}
    for _ in range(4):
        proc = provider(b.addr, "--batch-window-ms", "5")
        procs[proc.wait_for("listening", timeout=60)["peer_id"]] = proc
    wait_joined(b.http, procs)
    name = add_model(b.http, package)["model"]
    route = wait_ready(b.http, name, backups=1)["stages"]
    victim = route[1]["providers"][0]["peer_id"]
    streamed = [0] * SESSIONS
    all_going = asyncio.Event()

    async with AsyncClient(b.http, cache_dir=tmp_path / "cache", timeout=20) as fa:

        async def one(i: int, prompt: list[int]) -> Any:
            stream = fa.generate(prompt, NEW_TOKENS, temperature=0, model=name)
            async for _ in stream:
                streamed[i] += 1
                if min(streamed) >= 4:
                    all_going.set()
            return stream.result

        async def killer() -> None:
            await asyncio.wait_for(all_going.wait(), 120)
            procs[victim].stop()

        jobs = [one(i, p) for i, p in enumerate(_prompts())]
        if kill:
            *results, _ = await asyncio.gather(*jobs, killer())
        else:
            results = await asyncio.gather(*jobs)
    return procs, results, route


@pytest.mark.parametrize("precision", ["fp32", pytest.param("fp16", marks=pytest.mark.slow)])
async def test_sixteen_generations_share_provider_runs_through_a_provider_kill(
    broker: Spawner,
    provider: Spawner,
    llama3_packages: dict[str, Path],
    tmp_path: Path,
    precision: str,
) -> None:
    package = llama3_packages[precision]
    procs, results, route = await _swarm_run(broker, provider, package, tmp_path, kill=True)
    victim = route[1]["providers"][0]["peer_id"]
    for prompt, result in zip(_prompts(), results, strict=True):
        tokens, gaps = greedy_with_gaps(package, prompt, NEW_TOKENS)
        assert same_as_alone(result.tokens, tokens, gaps), (precision, result.tokens, tokens)
        assert victim in {f.peer for f in result.failovers}  # every session moved
    assert procs[victim].proc.poll() is not None
    # the providers that served the stages ran steps of several sessions at once
    survivors = [p for peer, p in procs.items() if peer != victim]

    def shared_runs() -> list[dict[str, Any]]:
        for p in survivors:
            p.drain_events()
        return [e for p in survivors for e in p.events if e["event"] == "batches"]

    runs = wait_until("runs reported", shared_runs, 10)
    assert max(e["largest"] for e in runs) > 1, runs
