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
    broker: Spawner, provider: Spawner, package: Path, tmp_path: Path
) -> tuple[dict[str, Proc], list[Any], str]:
    """16 greedy generations at once through a 3-stage model on 4 providers (one a backup);
    a provider serving a stage that has a backup is killed once every session has 4 tokens.
    Returns (providers, generations, the killed provider's peer id)."""
    from client import AsyncClient

    b: BrokerProc = broker()
    procs: dict[str, Proc] = {}
    for _ in range(4):
        proc = provider(b.addr, "--batch-window-ms", "5")
        procs[proc.wait_for("listening", timeout=60)["peer_id"]] = proc
    wait_joined(b.http, procs)
    name = add_model(b.http, package)["model"]

    def backed() -> list[dict[str, Any]] | None:  # the placement gives the spare to a stage
        stages = wait_ready(b.http, name)["stages"]
        return stages if any(s["backups"] for s in stages) else None

    route = wait_until(f"{name} served, a stage with a backup", backed, 90)
    victim = next(s for s in route if s["backups"])["providers"][0]["peer_id"]
    going: list[Any] = []  # each generation's result, filling in as its tokens come

    async with AsyncClient(b.http, cache_dir=tmp_path / "cache", timeout=20) as fa:

        async def one(prompt: list[int]) -> Any:
            stream = fa.generate(prompt, NEW_TOKENS, temperature=0, model=name)
            going.append(stream.result)
            async for _ in stream:  # (no text pieces: the package has no tokenizer)
                pass
            return stream.result

        async def killer() -> None:  # once every session has 4 tokens (polled: no callback)
            for _ in range(20_000):
                if len(going) == SESSIONS and min(len(r.tokens) for r in going) >= 4:
                    break
                await asyncio.sleep(0.005)
            procs[victim].stop()

        *results, _ = await asyncio.gather(*(one(p) for p in _prompts()), killer())
    return procs, results, victim


@pytest.mark.parametrize("precision", ["fp32", pytest.param("fp16", marks=pytest.mark.slow)])
async def test_sixteen_generations_share_provider_runs_through_a_provider_kill(
    broker: Spawner,
    provider: Spawner,
    llama3_packages: dict[str, Path],
    tmp_path: Path,
    precision: str,
) -> None:
    package = llama3_packages[precision]
    procs, results, victim = await _swarm_run(broker, provider, package, tmp_path)
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
