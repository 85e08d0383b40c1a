"""The SDK against a real broker and real provider processes: embeddings, batch jobs, typed
errors, and generation sessions the client runs itself over p2p, through a provider's death and
through a pipeline mixing the onnxruntime and torch executors."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.procs import ROOT, Proc, fusionai, wait_until
from tests.procs import sample_texts as texts
from tests.test_broker.conftest import (
    BrokerProc,
    add_model,
    api,
    local_embeddings,
    wait_joined,
    wait_ready,
)
from tests.test_broker.test_gateway import local_greedy

pytestmark = pytest.mark.timeout(300)
Spawner = Callable[..., Any]
PROMPT = "Models travel as ONNX"


def peers_of(stage: dict[str, Any]) -> set[str]:
    return {p["peer_id"] for p in stage["providers"]}


def start_providers(b: BrokerProc, provider: Spawner, *extras: tuple[str, ...]) -> dict[str, Proc]:
    """Providers started one by one, returned once the broker lists them all."""
    procs = {}
    for extra in extras:
        proc = provider(b.addr, *extra)
        procs[proc.wait_for("listening", timeout=60)["peer_id"]] = proc
    wait_joined(b.http, procs)
    return procs


def test_embeddings_jobs_and_typed_errors(
    broker: Spawner, provider: Spawner, minilm_package: Path, tmp_path: Path
) -> None:
    from client import Client, JobFailed, NotFoundError, UnavailableError
    from client.errors import BadRequestError, BrokerUnreachable, FusionAIError

    b: BrokerProc = broker()
    start_providers(b, provider, (), ())
    add_model(b.http, minilm_package)
    wait_ready(b.http, "minilm")
    sample = texts(40)
    expected = local_embeddings(minilm_package, sample)
    with Client(b.http, cache_dir=tmp_path / "cache", timeout=60) as fa:
        got = fa.embed(sample)  # the only encoder: no model named
        assert got.shape == expected.shape and got.dtype == np.float32
        assert np.abs(got - expected).max() <= 1e-4
        assert np.abs(fa.embed(sample[3], model="minilm")[0] - expected[3]).max() <= 1e-4

        job = fa.submit({"model": "minilm", "texts": sample, "microbatch": 8})
        assert job.model == "minilm" and job.microbatches == 5
        seen: list[float] = []
        done = fa.wait(job.id, progress=lambda j: seen.append(j.progress), timeout=120)
        assert done.state == "succeeded" and seen[-1] == 1.0
        assert np.abs(fa.results(job.id, page=7) - expected).max() <= 1e-4

        out = run_cli("embed", *sample[:3], "--broker", b.http, "--json")
        assert np.abs(np.array(json.loads(out)["embeddings"]) - expected[:3]).max() <= 1e-4
        assert run_cli("embed", sample[0], "--broker", b.http).startswith("384 dims")

        swarm = fa.swarm()  # typed: the broker's own structs
        assert len(swarm.providers) == 2 and {p.pool for p in swarm.providers} <= {
            "active",
            "backup",
        }
        assert [m.model for m in swarm.models] == ["minilm"]
        assert [m.id for m in fa.models()] == ["minilm"] and fa.model("minilm").ready

        with pytest.raises(NotFoundError, match="no model named 'nope'"):
            fa.embed(["x"], model="nope")
        with pytest.raises(NotFoundError):
            fa.job("no-such-job")
        with pytest.raises(BadRequestError) as bad:
            fa.submit({"model": "minilm", "texts": "not a list"})
        assert bad.value.field == "texts"
        with pytest.raises(FusionAIError, match="one decoder"):
            fa.generate(PROMPT, stream=False)
        with pytest.raises(ValueError, match="max_new_tokens"):
            fa.generate(PROMPT, 0)

        big = fa.submit({"model": "minilm", "texts": texts(4000), "microbatch": 8})
        assert fa.cancel(big.id).state == "cancelled"
        with pytest.raises(JobFailed, match="cancelled"):
            fa.wait(big.id)
    assert issubclass(UnavailableError, FusionAIError)
    with (
        Client("http://127.0.0.1:9", timeout=5, retry_s=0) as gone,
        pytest.raises(BrokerUnreachable),
    ):
        gone.swarm()


async def test_greedy_generation_equals_local_through_a_provider_death(
    broker: Spawner, provider: Spawner, llama_package: Path, tmp_path: Path
) -> None:
    """Every provider dies at its 14th request for the last block stage; only the one serving
    it first gets there: its backup takes 2 + (20 - 14) requests for the 20-token answer."""
    from client import AsyncClient

    steps = 20
    tokens, text = local_greedy(llama_package, PROMPT, steps)
    assert len(tokens) == steps, "the reference must not stop early for this test"
    b: BrokerProc = broker()
    fault = ("--fault", "die-at-step=14,on=tiny-llama/2")
    procs = start_providers(b, provider, fault, fault, fault, fault)
    add_model(b.http, llama_package)
    route = wait_ready(b.http, "tiny-llama", backups=1)
    assert route["stages"][1]["key"] == "tiny-llama/2"
    victim = route["stages"][1]["providers"][0]["peer_id"]
    async with AsyncClient(b.http, cache_dir=tmp_path / "cache", timeout=20) as fa:
        stream = fa.generate(PROMPT, steps, temperature=0)  # the only decoder
        pieces = [piece async for piece in stream]
        result = stream.result
        assert result.tokens == tokens
        assert "".join(pieces) == result.text == text
        assert result.finish_reason == "length"
        # every stage the dead provider served fails over (in stage order: the chained step
        # that found it dead goes again the star way, stage after stage)
        served = [p for p, s in enumerate(route["stages"]) if victim in peers_of(s)]
        assert [f.peer for f in result.failovers] == [victim] * len(served), result.failovers
        assert 1 in served and result.failovers[0].stage == served[0]
        assert sorted(f.stage for f in result.failovers) == served
        assert result.route[1] != victim
        # a lone generation's steps went provider to provider, over the real transport, but
        # for the prompt and the step that found the provider dead (the star way)
        assert result.chained == steps - 2, result.chained
        gap = np.diff(result.token_times).max()
        assert gap < 10, f"the answer stalled {gap:.1f} s at the failover"
        # a second, short greedy run on the repaired route (its providers stay under their 14
        # requests: the replacement has had 8) gives the same tokens with no failover
        fa.verify_share = 1.0  # and the broker's own run reproduces its signed commitments
        again = await fa.generate(PROMPT, 4, stream=False)
        assert again.tokens == tokens[:4] and not again.failovers
        assert again.route[1] == result.route[1]
        assert again.verified is True, again.verdict
        assert [(v.stage, v.ok) for v in again.verdict.sessions] == [
            ("tiny-llama/1", True),
            ("tiny-llama/2", True),
        ]
    assert procs[victim].proc.poll() is not None, "the provider should have died"
    assert [p for p, proc in procs.items() if proc.proc.poll() is not None] == [victim]


async def test_a_pipeline_mixing_onnxruntime_and_torch_providers_over_the_int8_wire(
    broker: Spawner,
    provider: Spawner,
    llama_package: Path,
    llama_int8_wire_package: Path,
    tmp_path: Path,
) -> None:
    """Stage 1 runs on an onnxruntime provider, stage 2 on a torch-executor provider (the
    test's router picks them by executor), the hidden states sent between them as int8
    blocks: the tokens equal the in-process run's and the fp32 wire's, and every hidden
    state crossed the network at 136 bytes a token instead of 512."""
    pytest.importorskip("torch")
    from client import AsyncClient
    from client.routing import HttpRouter
    from client.sampling import Sampler
    from client.session import GenerationSession, generate

    steps = 12
    tokens, _ = local_greedy(llama_int8_wire_package, PROMPT, steps)
    assert tokens == local_greedy(llama_package, PROMPT, steps)[0]  # the fp32 wire's
    b: BrokerProc = broker("--replicas", "2", "--heartbeat-s", "2")  # no spurious losses
    procs = start_providers(b, provider, ("--executor", "ort"), ("--executor", "torch"))
    ort_peer, torch_peer = list(procs)
    add_model(b.http, llama_int8_wire_package)

    def both_serve_both() -> dict[str, Any] | None:
        _, route = api(b.http, "GET", "/v1/models/tiny-llama")
        serving = [{p["peer_id"] for p in s["providers"]} for s in route["stages"]]
        ok = route["ready"] and ort_peer in serving[0] and torch_peer in serving[1]
        return route if ok else None

    from tests.procs import wait_until

    route = wait_until("a route mixing both providers", both_serve_both, 90)
    keys = [s["key"] for s in route["stages"]]

    class Pinned(HttpRouter):
        async def pick(self, pos: int, avoid: set[str]) -> str:
            want = [ort_peer, torch_peer][pos]
            peer = await super().pick(pos, avoid | ({ort_peer, torch_peer} - {want}))
            assert peer == want
            return peer

    async with AsyncClient(b.http, cache_dir=tmp_path / "cache", timeout=20) as fa:
        stages = await fa.stages("tiny-llama")
        host = await fa._p2p()
        session = GenerationSession(host, stages, keys, Pinned(fa, "tiny-llama"), timeout=20)
        ids = stages.tokenizer.encode(PROMPT).ids
        try:
            got = [t async for t in generate(session, ids, steps, Sampler(0.0), stops=stages.stops)]
        finally:
            await session.close()
        assert [s.peer for s in session.stages] == [ort_peer, torch_peer]
    assert got == tokens
    assert session.failovers == 0
    # sent to and back from each of the 2 stages, every token fed: 128 int8 + 2 scales
    assert session.wire == "int8" and session.hidden_bytes == 2 * 2 * session.past * (128 + 8)


def test_sync_client_streams_and_closes_its_thread(
    broker: Spawner, provider: Spawner, llama_package: Path, tmp_path: Path
) -> None:
    import threading

    from client import Client, FusionAIError

    tokens, text = local_greedy(llama_package, PROMPT, 8)
    b: BrokerProc = broker()
    start_providers(b, provider, (), ())
    add_model(b.http, llama_package)
    wait_ready(b.http, "tiny-llama")
    fa = Client(b.http, cache_dir=tmp_path / "cache", timeout=20)
    pieces = fa.generate(PROMPT, 8, model="tiny-llama")
    assert "".join(pieces) == text and pieces.result.tokens == tokens
    with pytest.raises(ValueError, match=r"outside 0\.\.511"):
        fa.generate([5, 100_000], 2, stream=False)
    ids = fa.generate(tokens[:3], 2, stream=False)  # token ids in, no tokenizer needed
    assert ids.tokens == local_greedy_ids(llama_package, tokens[:3], 2)
    fa.close()
    fa.close()  # idempotent
    assert "fusionai-client" not in {t.name for t in threading.enumerate()}
    with pytest.raises(FusionAIError, match="closed"):
        fa.swarm()

    # the same from the shell
    cache = {"FUSIONAI_CACHE_DIR": str(tmp_path / "cli-cache")}
    out = run_cli("generate", PROMPT, "-n", "8", "--broker", b.http, "--json", env=cache)
    assert json.loads(out)["tokens"] == tokens and json.loads(out)["text"] == text
    streamed = run_cli("generate", PROMPT, "-n", "8", "--broker", b.http, env=cache)
    assert streamed == text + "\n"
    swarm = json.loads(run_cli("swarm", "--broker", b.http, "--json"))
    assert [m["model"] for m in swarm["models"]] == ["tiny-llama"]
    assert "tiny-llama/1" in run_cli("swarm", "--broker", b.http)
    bad = subprocess.run(
        fusionai("generate", "x", "--model", "nope", "--broker", b.http),
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert bad.returncode == 1 and "no model named 'nope'" in bad.stderr


def run_cli(*args: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        fusionai(*args), capture_output=True, text=True, timeout=120, cwd=ROOT,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def local_greedy_ids(package: Path, prompt: list[int], steps: int) -> list[int]:
    from ir.executors.ort import OrtExecutor
    from ir.package import load_package
    from ir.pipeline import LocalPipeline

    pkg = load_package(package)
    executors = [OrtExecutor(pkg.models[s.index]) for s in pkg.manifest.stages]
    out: list[int] = LocalPipeline(pkg.manifest, executors).generate_greedy(prompt, steps)
    return out


async def test_shadow_steps_catch_a_wrong_provider_and_generation_stays_exact(
    broker: Spawner, provider: Spawner, llama_package: Path, tmp_path: Path
) -> None:
    """One of four providers adds 1 to every output. With `verify=True` each stage's step
    also runs on the stage's other holder; the disagreement is reported, the broker's own
    probe finds the wrong provider and quarantines it, and the tokens equal the local run."""
    from client import AsyncClient

    steps = 8
    tokens, _ = local_greedy(llama_package, PROMPT, steps)
    b: BrokerProc = broker("--verify-fraction", "0", "--replicas", "2")  # 2 serve each stage
    procs = start_providers(b, provider, ("--fault", "wrong-output"), (), (), ())
    bad = next(iter(procs))
    add_model(b.http, llama_package)
    wait_ready(b.http, "tiny-llama")

    def placed_with_bad() -> dict[str, Any] | None:  # (ready may come before all 4 are placed)
        _, route = api(b.http, "GET", "/v1/models/tiny-llama")
        held = any(bad in peers_of(s) or bad in s["backups"] for s in route["stages"])
        return route if route["ready"] and held else None

    route = wait_until("the wrong provider placed", placed_with_bad, 60)
    keys = [s["key"] for s in route["stages"]]

    def held_twice() -> bool:  # every stage loaded on a second provider, as it reports
        loaded = [p["loaded"] for p in api(b.http, "GET", "/v1/providers")[1]["providers"]]
        return all(sum(key in held for held in loaded) >= 2 for key in keys)

    wait_until("a second holder of every stage", held_twice)
    async with AsyncClient(b.http, cache_dir=tmp_path / "cache", timeout=20) as fa:
        # Checkers are drawn at random among a stage's other holders: within a few sessions
        # the wrong provider serves or checks one. Every session's tokens are exact.
        for _ in range(12):
            result = await fa.generate(PROMPT, steps, stream=False, verify=True)
            assert result.tokens == tokens
            # (a shadow step that fails, e.g. times out on a loaded machine, is unchecked)
            assert result.checked >= steps and result.checked + result.unchecked >= 2 * steps
            if result.distrusted:
                break
        assert result.distrusted == [bad], (result.checked, result.route, route)
        assert bad not in result.route
        caught = b.proc.wait_for("provider_quarantined", lambda e: e["peer"] == bad, timeout=10)
        assert "probe" in caught["reason"]
        _, out = api(b.http, "GET", "/v1/providers")
        assert [q["peer_id"] for q in out["quarantined"]] == [bad]
        # Without verify, the repaired route gives the same tokens.
        again = await fa.generate(PROMPT, steps, stream=False)
        assert again.tokens == tokens and bad not in again.route
    procs[bad].wait_for("join_refused", lambda e: "quarantined" in e["reason"], timeout=30)
