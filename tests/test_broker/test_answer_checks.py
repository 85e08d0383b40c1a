"""The OpenAI endpoints have a sampled share of their answers checked against the providers'
signed commitments (`--verify-share`, on by default): a streaming client is told in the
stream, a provider whose work the broker does not reproduce is quarantined. In-process (a real
broker, its HTTP API, real provider daemons and ONNX stages on an in-memory network)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from broker.config import BrokerConfig
from provider.faults import Fault
from tests.test_broker.inproc import Swarm, swarm

pytestmark = pytest.mark.timeout(120)
BODY = {"model": "tiny-llama", "prompt": "the swarm", "max_tokens": 40, "temperature": 0}


async def _events(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[Any]:
    """The `data:` payloads of a streamed completion, in order ("[DONE]" as it is)."""
    out: list[Any] = []
    async with http.post(url + "/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data:"):
                data = line[5:].strip()
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def _served(s: Swarm, model: str) -> None:
    await s.until("a route", lambda: all(s.broker.serving.route(model) or [[]]), 60)


async def test_a_streamed_answer_from_a_lying_provider_is_flagged_and_the_provider_quarantined(
    tmp_path: Path, llama_package: Path
) -> None:
    assert BrokerConfig(data_dir=tmp_path).verify_share == 0.21  # on by default
    s = await swarm(tmp_path / "swarm", verify_share=1.0)
    try:
        liar = await s.provider(fault=Fault(wrong_output=True))
        assert liar.host is not None
        liar_id = liar.host.peer_id
        model = await s.add_model(llama_package)
        await _served(s, model)
        url = s.broker.http_url
        async with aiohttp.ClientSession() as http:
            events = await _events(http, url, BODY)
            chunks = events[:-1]
            assert events[-1] == "[DONE]" and all(c["choices"] for c in chunks)
            # the check rides on the answer's last chunk, the one with its finish reason
            (checked,) = [c for c in chunks if "verification" in c]
            assert checked is chunks[-1]
            assert checked["choices"][0]["finish_reason"] in ("stop", "length")
            (found,) = checked["verification"]
            verdict = found["verdict"]
            assert found["index"] == 0 and verdict["ok"] is False
            assert verdict["quarantined"] == [liar_id]
            first = next(v for v in verdict["sessions"] if v["stage"] == f"{model}/1")
            assert first["ok"] is False and "outputs differ" in first["reason"]
            assert liar_id in {q.peer_id for q in s.broker.verifier.quarantined_list()}
            assert [e["ok"] for e in s.events("generation_verified")] == [False]

            # an honest provider takes the model over; its answer (not streamed) checks out
            await s.provider()
            await _served(s, model)
            async with http.post(url + "/v1/completions", json=BODY) as resp:
                assert resp.status == 200, await resp.text()
                answer = await resp.json()
            (found,) = answer["verification"]
            assert found["verdict"]["ok"] is True and found["verdict"]["quarantined"] == []
            assert all(v["ok"] for v in found["verdict"]["sessions"]), found
            assert answer["choices"][0]["text"]
    finally:
        await s.close()


async def test_answers_run_alone_with_client_batching_off(
    tmp_path: Path, llama_package: Path
) -> None:
    """`--no-client-batching`: the endpoints run each answer's embedding, head and steps on
    its own; concurrent answers come out whole, and the broker's check reproduces them."""
    import asyncio

    s = await swarm(tmp_path / "swarm", verify_share=1.0, client_batching=False)
    try:
        await s.provider()
        model = await s.add_model(llama_package)
        await _served(s, model)
        url = s.broker.http_url
        bodies = [{**BODY, "prompt": p, "max_tokens": 12} for p in ("the swarm", "a gaming pc")]
        async with aiohttp.ClientSession() as http:

            async def ask(body: dict[str, Any]) -> Any:
                async with http.post(url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    return await resp.json()

            answers = await asyncio.gather(*(ask(b) for b in bodies * 2))
        for a in answers:
            assert 1 <= a["usage"]["completion_tokens"] <= 12, a
            assert a["choices"][0]["finish_reason"] in ("stop", "length"), a
        assert all(a["verification"][0]["verdict"]["ok"] for a in answers), answers
    finally:
        await s.close()


async def test_the_endpoints_sessions_know_where_each_provider_is(
    tmp_path: Path, llama_package: Path
) -> None:
    """The OpenAI endpoints' generation sessions name each provider picked with its announced
    addresses, as the SDK's do: a chained step's hop not yet connected to the next dials it by
    them (without, it answered "could not reach", and every session fell back to the star way
    after a second's wait for a push that never came)."""
    from broker.local_gateway import BrokerRouter

    s = await swarm(tmp_path / "swarm")
    try:
        provider = await s.provider()
        assert provider.host is not None
        model = await s.add_model(llama_package)
        await _served(s, model)
        router = s.broker.gateway.backend.router(model)
        assert isinstance(router, BrokerRouter)
        peer = await router.pick(0, set())
        assert peer == provider.host.peer_id
        assert router.addrs == {peer: list(provider.host.addrs)} and router.addrs[peer]
    finally:
        await s.close()
