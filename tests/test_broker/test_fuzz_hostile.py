"""The whole HTTP API fuzzed with hostile values, against a live broker serving real models
(an encoder and a decoder, each on a provider): every operation's requests generated from its
OpenAPI schema (schemathesis), ones it allows and ones it forbids, half of those with a model
naming one that exists, and each sent again
`VARIANTS` times with one of its values replaced by something hostile: an unpaired surrogate,
a 5,000-digit or out-of-range integer, a non-finite or negative number, a 2-million-character
string, a name with a trailing newline, a control character, deep nesting; operations without
a body get hostile path segments and query values instead. At least 10,000 requests; none may
get a 500 or a non-JSON error, and the broker stays up and answers a real request at the end."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from broker.openapi import document
from tests.procs import wait_until
from tests.test_broker.conftest import BrokerProc, add_model, api, wait_joined

schemathesis = pytest.importorskip("schemathesis")
import hypothesis.errors  # noqa: E402
import requests  # noqa: E402  (a dependency of schemathesis)
from hypothesis import HealthCheck, given, settings  # noqa: E402

pytestmark = pytest.mark.slow

SCHEMA = schemathesis.openapi.from_dict(document()).exclude(
    path_regex=r"^/v1/stream$|^/v1/jobs/\{id\}/events$|^/$|^/metrics$"
)
MODELS = ("minilm", "tiny-llama")
HOSTILE = [
    rb'"\ud800"',
    rb'"a\udfffb"',
    rb'"\ud83d"',
    b"1" * 5000,
    b"-1" * 1,
    b"-9223372036854775809",
    b"18446744073709551616",
    b"1e999",
    b"-1e999",
    b"-0.0",
    b'"minilm\\n"',
    b'"tiny-llama\\u0000"',
    b'"' + b"a" * 2_000_000 + b'"',
    b"[" * 10_000,
    b"null",
    b"{}",
]
PATH_HOSTILE = ["%ED%A0%80", "%00", "a" * 5000, "..%2F..%2Fetc", "1" * 5000, "-1", "%FF%FE"]
VARIANTS = 5  # hostile copies of each generated request
EXAMPLES = 30  # requests generated for each operation, allowed and forbidden ones each
LEAF = re.compile(rb'"(?:[^"\\]|\\.)*"|-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|true|false|null')
SENT: list[int] = [0]


@pytest.fixture(scope="module")
def live(
    tmp_path_factory: pytest.TempPathFactory, minilm_package: Path, llama_package: Path
) -> Iterator[BrokerProc]:
    from tests.procs import Proc, broker_command, provider_command

    data = tmp_path_factory.mktemp("hostile-broker")
    # (hardware checked: a provider that joins later does not displace the served model)
    broker = Proc(broker_command(data / "b", check_hardware=True))
    providers: list[Proc] = []
    try:
        started = broker.wait_for("broker_started", timeout=30)
        live = BrokerProc(broker, started["addrs"][0], started["http"])
        for i, package in enumerate((minilm_package, llama_package)):  # one provider each
            providers.append(  # (each measured under this test's load: the broker checks it)
                Proc(provider_command(live.addr, data / f"p{i}", measure=True))
            )
            wait_joined(live.http, [providers[-1].wait_for("listening", timeout=60)["peer_id"]])
            add_model(live.http, package)
            wait_until(f"{MODELS[i]} served", lambda i=i: MODELS[i] in _ready(live.http), 120)
        yield live
    finally:
        for provider in providers:
            provider.stop()
        broker.stop()


@pytest.fixture(scope="module")
def http() -> Iterator[requests.Session]:
    with requests.Session() as session:
        yield session


def _ready(http: str) -> set[str]:
    _, out = api(http, "GET", "/v1/models")
    return {m["model"] for m in out["models"] if m["ready"]}


def _check(response: requests.Response, what: str, live: BrokerProc) -> None:
    what = f"{what} -> {response.status_code}"
    log = "".join(live.proc.stderr[-40:])
    assert response.status_code != 500, f"{what}: {response.text[:500]}\n{log}"
    if response.status_code >= 400:
        try:
            body = json.loads(response.content)
        except ValueError:
            raise AssertionError(f"{what}: not JSON: {response.content[:200]!r}") from None
        assert isinstance(body["error"]["message"], str) and body["error"]["message"], what


def _hostile(raw: bytes, rng: random.Random) -> bytes:
    """`raw` JSON with one leaf value replaced by a hostile one (or the body itself)."""
    leaves = list(LEAF.finditer(raw))
    bad = rng.choice(HOSTILE)
    if not leaves:
        return bad
    leaf = rng.choice(leaves)
    return raw[: leaf.start()] + bad + raw[leaf.end() :]


def _fuzz(case: Any, live: BrokerProc, http: requests.Session) -> None:
    """Send one generated request and `VARIANTS` hostile copies of it; none may get a 500."""
    rng = random.Random(repr(case.body) + repr(case.path_parameters) + repr(case.query))
    if isinstance(case.body, dict) and "model" in case.body and rng.random() < 0.5:
        case.body["model"] = rng.choice(MODELS)
    if isinstance(case.body, dict) and isinstance(case.body.get("max_tokens"), int):
        case.body["max_tokens"] = min(case.body["max_tokens"], 4)  # (a short answer)
    response = case.call(base_url=live.http, session=http, timeout=60)
    SENT[0] += 1
    _check(response, f"{case.method} {case.formatted_path}", live)
    for _ in range(VARIANTS):
        if case.method in ("POST", "PUT") and isinstance(case.body, dict | list):
            raw = _hostile(json.dumps(case.body).encode(), rng)
            url = live.http + case.formatted_path
        else:  # a hostile path segment, or query value
            raw, url = None, live.http + case.formatted_path
            bad = rng.choice(PATH_HOSTILE)
            segments = url.split("/")
            if case.path_parameters and rng.random() < 0.5:
                segments[-1] = bad
                url = "/".join(segments)
            else:
                url += f"?{rng.choice(['since', 'limit', 'offset', 'token', 'x'])}={bad}"
        response = http.request(
            case.method, url, data=raw, headers={"Content-Type": "application/json"}, timeout=60
        )
        SENT[0] += 1
        what = f"{case.method} {url[:200]} (hostile: {(raw or b'')[:120]!r})"
        _check(response, what, live)
    assert live.proc.proc.poll() is None, "the broker died"


@pytest.mark.timeout(900)
def test_no_request_gets_a_500_and_the_broker_still_serves(
    live: BrokerProc, http: requests.Session
) -> None:
    """Every operation in turn, in one test: one worker of a parallel run (`make test-slow`
    runs two) builds the swarm once and counts every request (schemathesis' own items, one an
    operation, would be spread over the workers, each building a swarm and counting part)."""
    for result in SCHEMA.get_all_operations():
        operation = result.ok()
        # requests the schema allows, and requests it forbids (a field of the wrong type,
        # one missing, one too long, ...), each then sent again with hostile values
        for mode in schemathesis.GenerationMode:

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(
                max_examples=EXAMPLES,
                deadline=None,
                suppress_health_check=list(HealthCheck),
                derandomize=True,
                database=None,
            )
            def one(case: Any) -> None:
                _fuzz(case, live, http)

            try:
                one()
            except hypothesis.errors.Unsatisfiable:  # (nothing forbidden to send: no input)
                assert mode == schemathesis.GenerationMode.NEGATIVE, operation.label
    print(f"{SENT[0]} requests sent")
    assert SENT[0] >= 10_000, f"only {SENT[0]} requests were sent"
    status, out = api(live.http, "POST", "/v1/embeddings", {"model": "minilm", "input": "hi"})
    assert status == 200 and len(out["data"][0]["embedding"]) == 384
