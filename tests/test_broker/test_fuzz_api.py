"""The HTTP API fuzzed from its own OpenAPI document (schemathesis): requests generated from every
operation's schema, and malformed ones, against a live broker process. No answer is a 500,
every error is JSON that says what is wrong, and the broker stays up throughout."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from broker.openapi import document
from tests.test_broker.conftest import BrokerProc, api

schemathesis = pytest.importorskip("schemathesis")
import requests  # noqa: E402  (a dependency of schemathesis)
from hypothesis import HealthCheck, settings  # noqa: E402

SCHEMA = (
    schemathesis.openapi.from_dict(document())
    # server-sent event streams never end; the dashboard and metrics are not JSON
    .exclude(path_regex=r"^/v1/stream$|^/v1/jobs/\{id\}/events$|^/$|^/metrics$")
)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProc]:
    from tests.procs import Proc, broker_command

    data = tmp_path_factory.mktemp("fuzzed-broker")
    proc = Proc(broker_command(data, port=0, http_port=0, heartbeat_s=0.5))
    try:
        started = proc.wait_for("broker_started", timeout=30)
        yield BrokerProc(proc, started["addrs"][0], started["http"])
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def http() -> Iterator[requests.Session]:
    """One HTTP session for every generated request, closed at the end (no sockets left)."""
    with requests.Session() as session:
        yield session


def _check(response: Any) -> None:
    what = f"{response.request.method} {response.request.url} -> {response.status_code}"
    assert response.status_code != 500, f"{what}: {response.text[:500]}"
    if response.status_code >= 400:
        try:
            body = json.loads(response.content)  # an error is JSON, never an HTML page
        except ValueError:
            raise AssertionError(f"{what}: not JSON: {response.content[:200]!r}") from None
        assert isinstance(body["error"]["message"], str) and body["error"]["message"], what


@pytest.mark.timeout(600)
@SCHEMA.parametrize()
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_generated_requests_get_clear_answers(
    case: Any, live: BrokerProc, http: requests.Session
) -> None:
    response = case.call(base_url=live.http, session=http, timeout=30)
    _check(response)
    if response.status_code >= 400 and case.method != "GET":
        assert live.proc.proc.poll() is None, "the broker died"


def test_the_broker_is_still_up_after_the_fuzzing(live: BrokerProc) -> None:
    status, out = api(live.http, "GET", "/healthz")
    assert status == 200 and out["ok"]
