"""A generation checked against its providers' signed commitments by the broker's own run
(`POST /v1/models/{name}/verify`), over real processes and TCP: a provider that answers
wrong hidden states is caught, quarantined, and the client told."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.test_broker.conftest import BrokerProc, add_model, api, wait_ready
from tests.test_client.test_sdk import PROMPT, Spawner, start_providers

pytestmark = pytest.mark.timeout(300)


async def test_a_provider_whose_commitments_the_broker_cannot_reproduce_is_quarantined(
    broker: Spawner, provider: Spawner, llama_package: Path, tmp_path: Path
) -> None:
    from client import AsyncClient
    from client.verifying import GenerationWarning

    b: BrokerProc = broker("--verify-fraction", "0")  # (no spot checks: commitments alone)
    (liar,) = start_providers(b, provider, ("--fault", "wrong-output"))  # both stages
    add_model(b.http, llama_package)
    wait_ready(b.http, "tiny-llama")
    async with AsyncClient(
        b.http, cache_dir=tmp_path / "cache", timeout=20, verify_share=1.0
    ) as fa:
        with pytest.warns(GenerationWarning, match="did not reproduce.*quarantined now"):
            result = await fa.generate(PROMPT, 40, temperature=0, stream=False)
    assert result.verified is False
    verdict: Any = result.verdict
    assert verdict.quarantined == [liar]
    judged = {v.stage: v.ok for v in verdict.sessions}
    # its first stage's outputs are off, so the second stage (given them) is not judged
    assert judged == {"tiny-llama/1": False, "tiny-llama/2": None}, verdict
    first = next(v for v in verdict.sessions if v.stage == "tiny-llama/1")
    assert first.chunks == 2 and first.peer_id == liar and "outputs differ" in first.reason
    _, listed = api(b.http, "GET", "/v1/providers")
    (bad,) = [q for q in listed["quarantined"] if q["peer_id"] == liar]
    assert "commitments" in bad["reason"]
    events = [e for e in api(b.http, "GET", "/v1/events")[1]["events"]]
    assert any(e["kind"] == "generation_verified" and not e["ok"] for e in events)


def test_a_streaming_client_is_told_in_the_stream_when_the_check_fails(
    broker: Spawner, provider: Spawner, llama_package: Path
) -> None:
    """The broker's OpenAI endpoint checks the answer (`--verify-share 1`): the streamed
    answer's last chunk carries the failed verdict, and the liar is quarantined."""
    import json
    import urllib.request

    b: BrokerProc = broker("--verify-fraction", "0", "--verify-share", "1")
    (liar,) = start_providers(b, provider, ("--fault", "wrong-output"))
    add_model(b.http, llama_package)
    wait_ready(b.http, "tiny-llama")
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 40, "temperature": 0,
            "stream": True}  # fmt: skip
    request = urllib.request.Request(
        b.http + "/v1/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=60) as resp:
        data = [line[5:].strip() for line in resp.read().decode().splitlines()
                if line.startswith("data:")]  # fmt: skip
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert all(c["choices"] for c in chunks) and chunks[-1]["choices"][0]["finish_reason"]
    (found,) = chunks[-1]["verification"]
    assert found["verdict"]["ok"] is False and found["verdict"]["quarantined"] == [liar]
    assert not any("verification" in c for c in chunks[:-1])
    _, listed = api(b.http, "GET", "/v1/providers")
    assert [q["peer_id"] for q in listed["quarantined"]] == [liar]
