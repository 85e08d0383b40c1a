"""Gateway processes in front of a broker, all real processes: the SDK's tokens through two
gateways, managed keys (a revoked key refused by both, a key's stream limit counted across
both), their traffic in the broker's `/metrics`, a gateway killed mid-stream, and (slow)
200 streams against a small swarm."""

from __future__ import annotations

import http.client
import json
import re
import signal
import statistics
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.procs import ROOT, Proc, fusionai, wait_until
from tests.test_broker.conftest import BrokerProc, add_model
from tests.test_broker.test_gateway import local_greedy

pytestmark = pytest.mark.timeout(300)
ADMIN = "fai-test-admin-key-0123456789"
PROMPT = "the swarm"


def keys(http: str, *args: str) -> dict[str, Any]:
    done = subprocess.run(
        fusionai("keys", *args, "--broker", http, "--api-key", ADMIN, "--json"),
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out: dict[str, Any] = json.loads(done.stdout)
    return out


def call(
    url: str, method: str, path: str, key: str | None, body: Any = None
) -> tuple[int, dict[str, str], Any]:
    """(status, headers, JSON) of one request."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    try:
        conn.request(method, path, json.dumps(body) if body is not None else None, headers)
        resp = conn.getresponse()
        return resp.status, dict(resp.headers), json.loads(resp.read() or b"null")
    finally:
        conn.close()


class Stream:
    """A streamed completion read chunk by chunk."""

    def __init__(self, url: str, key: str, max_tokens: int, **extra: Any) -> None:
        parts = urllib.parse.urlsplit(url)
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
        body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": max_tokens,
                "temperature": 0, "stream": True, **extra}  # fmt: skip
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
        self.conn.request("POST", "/v1/completions", json.dumps(body), headers)
        self.resp = self.conn.getresponse()
        self.times: list[float] = []
        self.done = False
        self.checked = False  # the answer's finish carried the broker's check

    def next(self) -> Any:
        """The next chunk's data ("[DONE]" at the end); raises once the connection fails."""
        while True:
            line = self.resp.readline()
            if not line:
                raise ConnectionError("the stream ended without [DONE]")
            text = line.decode().strip()
            if text.startswith("data: "):
                self.times.append(time.monotonic())
                data = text[6:]
                self.done = data == "[DONE]"
                if self.done:
                    return data
                chunk = json.loads(data)
                self.checked = self.checked or "verification" in chunk
                return chunk

    def rest(self) -> str:
        text = ""
        while (chunk := self.next()) != "[DONE]":
            assert "error" not in chunk, chunk
            text += chunk["choices"][0]["text"] if chunk["choices"] else ""
        return text

    def close(self) -> None:
        self.conn.close()


def start_gateway(
    spawn: Callable[..., Proc], http: str, key: str, name: str, *extra: str
) -> tuple[Proc, str]:
    proc = spawn(
        fusionai("gateway", "--broker", http, "--api-key", key, "--name", name, "--http",
                 "127.0.0.1:0", "--listen", "/ip4/127.0.0.1/tcp/0", "--json", *extra)
    )  # fmt: skip
    url: str = proc.wait_for("gateway_ready", timeout=60)["http"]
    return proc, url


def swarm(
    broker: Callable[..., BrokerProc], provider: Callable[..., Proc], package: Path, *extra: str
) -> BrokerProc:
    b = broker("--admin-key", ADMIN)
    procs = [provider(b.addr, *extra) for _ in range(2)]
    peers = {p.wait_for("listening", timeout=60)["peer_id"] for p in procs}

    def joined() -> bool:
        out = call(b.http, "GET", "/v1/providers", ADMIN)[2]
        return peers <= {p["peer_id"] for p in out["providers"]}

    wait_until("providers joined", joined, timeout=60)
    add_model(b.http, package, "--api-key", ADMIN)
    wait_until(
        "tiny-llama served",
        lambda: call(b.http, "GET", "/v1/models/tiny-llama", ADMIN)[2]["ready"],
        timeout=90,
    )
    return b


def metric(text: str, name: str, gateway: str) -> float:
    found = re.search(rf'^{name}\{{gateway="{gateway}",model="tiny-llama"\}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def test_two_gateways_keys_limits_metrics_and_a_gateway_killed(
    broker: Callable[..., BrokerProc],
    provider: Callable[..., Proc],
    spawn: Callable[..., Proc],
    llama_package: Path,
) -> None:
    b = swarm(broker, provider, llama_package)
    gw_key = keys(b.http, "add", "gateways", "--role", "gateway")["key"]
    user = call(b.http, "POST", "/v1/keys", ADMIN, {"name": "alice"})[2]["key"]  # (the API)
    limited = keys(b.http, "add", "bob", "--max-streams", "4")["key"]  # (the CLI)
    doomed = call(b.http, "POST", "/v1/keys", ADMIN, {"name": "carol"})[2]
    # a user's key is not a gateway's: the broker refuses it as one
    status, _, out = call(b.http, "POST", "/v1/gateway/admit", user,
                          {"gateway": "g", "model": "tiny-llama"})  # fmt: skip
    assert status == 403, out
    refused = subprocess.run(
        fusionai("gateway", "--broker", b.http, "--api-key", user, "--http", "127.0.0.1:0"),
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode == 1 and "--role gateway" in refused.stderr, refused.stderr
    # (gw-b has the broker check every answer against its providers' commitments)
    shares = {"gw-a": ("--verify-share", "0"), "gw-b": ("--verify-share", "1")}
    procs = {g: start_gateway(spawn, b.http, gw_key, g, *shares[g]) for g in shares}
    gateways = {g: url for g, (_, url) in procs.items()}

    # Both give the tokens one process gives (greedy): the SDK's session logic behind them.
    _, expected = local_greedy(llama_package, PROMPT, 12)
    for g, url in gateways.items():
        body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
        status, _, out = call(url, "POST", "/v1/completions", user, body)
        assert status == 200, out
        assert out["choices"][0]["text"] == expected
        stream = Stream(url, user, 12)
        assert stream.rest() == expected
        stream.close()
        assert stream.checked == (g == "gw-b") and ("verification" in out) == (g == "gw-b")
        if g == "gw-b":  # checked through the broker's API with the gateway's key
            (found,) = out["verification"]
            assert found["verdict"]["ok"] is True and found["verdict"]["quarantined"] == [], out
    # No key, or a made-up one: 401 at a gateway, as at the broker.
    assert call(gateways["gw-a"], "GET", "/v1/models", None)[0] == 401
    assert call(gateways["gw-b"], "GET", "/v1/models", "fai-made-up-key-000000000")[0] == 401

    # A key limited to 4 streams: the 5th is refused, whichever gateway it goes to.
    urls = list(gateways.values())
    open_ = [Stream(urls[i % 2], limited, 400) for i in range(4)]
    for s in open_:
        first = s.next()
        assert "error" not in first, first
    for url in urls:
        body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 4}
        status, headers, out = call(url, "POST", "/v1/completions", limited, body)
        assert status == 429, out
        assert int(headers["Retry-After"]) >= 1
        assert "limit" in out["error"]["message"]
    for s in open_:
        s.close()  # the client leaves: its lease ends with the stream
    wait_until(
        "bob's streams freed",
        lambda: call(urls[1], "POST", "/v1/completions", limited,
                     {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 2})[0] == 200,
        timeout=20,
    )  # fmt: skip

    # Both gateways' traffic reaches the broker's /metrics.
    def counted() -> bool:
        text = call_text(b.http + "/metrics")
        return all(
            metric(text, "fusionai_gateway_generated_tokens_total", g) >= 24 for g in gateways
        )

    wait_until("gateways' tokens in the broker's metrics", counted, timeout=15)
    shown = {g["gateway"]: g for g in dashboard_snapshot(b.http)["gateways"]}
    assert set(shown) == {"gw-a", "gw-b"} and all(
        g["up"] and g["tokens"] >= 24 for g in shown.values()
    )

    # A revoked key: refused at once for new work, and within the decision's lifetime (5 s)
    # for everything, by both gateways.
    for url in urls:
        assert call(url, "GET", "/v1/models", doomed["key"])[0] == 200
    keys(b.http, "revoke", doomed["info"]["id"])
    revoked = time.monotonic()
    for url in urls:
        body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 2}
        assert call(url, "POST", "/v1/completions", doomed["key"], body)[0] == 401
    wait_until(
        "the revoked key refused everywhere",
        lambda: all(call(u, "GET", "/v1/models", doomed["key"])[0] == 401 for u in urls),
        timeout=10,
    )
    assert time.monotonic() - revoked <= 5.0 + 2.0

    # A gateway killed mid-stream: its client's stream fails within 5 s; the other serves on.
    stream = Stream(gateways["gw-b"], user, 400)
    assert "error" not in stream.next()
    other = Stream(gateways["gw-a"], user, 40)
    killed = time.monotonic()
    procs["gw-b"][0].signal(signal.SIGKILL)
    with pytest.raises((ConnectionError, OSError, http.client.HTTPException)):
        while stream.next() != "[DONE]":
            pass
    assert time.monotonic() - killed < 5.0
    assert not stream.done
    assert len(other.rest()) > 0
    wait_until("gw-a's tokens reported", counted, timeout=15)


def dashboard_snapshot(base: str) -> dict[str, Any]:
    """The first snapshot of the dashboard's feed."""
    parts = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    conn.request("GET", "/v1/stream", headers={"Authorization": f"Bearer {ADMIN}"})
    resp = conn.getresponse()
    event = ""
    try:
        while line := resp.readline().decode():
            if line.startswith("event: "):
                event = line[7:].strip()
            elif line.startswith("data: ") and event == "snapshot":
                out: dict[str, Any] = json.loads(line[6:])
                return out
    finally:
        conn.close()
    raise AssertionError("the feed ended without a snapshot")


def call_text(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    conn.request("GET", parts.path, headers={"Authorization": f"Bearer {ADMIN}"})
    text = conn.getresponse().read().decode()
    conn.close()
    return text


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_hundred_streams_get_200_or_429_and_the_admitted_keep_their_pace(
    broker: Callable[..., BrokerProc],
    provider: Callable[..., Proc],
    spawn: Callable[..., Proc],
    llama_package: Path,
) -> None:
    max_batch, providers = 8, 2
    tokens = 48  # long enough that the burst of 200 requests is a small part of each stream
    b = swarm(broker, provider, llama_package, "--max-batch", str(max_batch))
    gw_key = keys(b.http, "add", "gateways", "--role", "gateway")["key"]
    user = keys(b.http, "add", "alice")["key"]
    _, url = start_gateway(spawn, b.http, gw_key, "gw-a")

    def run(n: int) -> tuple[list[int], list[float], int]:
        """n streams at once: their statuses, the pace of each admitted one (its mean gap
        between chunks, past the first), and how many completed."""
        statuses: list[int] = [0] * n
        paces: list[float] = []
        lock = threading.Lock()

        def one(i: int) -> None:
            try:
                s = Stream(url, user, tokens)
            except OSError:
                statuses[i] = -1
                return
            statuses[i] = s.resp.status
            if s.resp.status != 200:
                body = json.loads(s.resp.read())
                assert "error" in body
                if s.resp.status == 429:
                    assert int(s.resp.headers["Retry-After"]) >= 1
                s.close()
                return
            s.rest()
            s.close()
            # past the first token (the prompt's), before [DONE]; a checked answer's finish
            # waits for the broker's check (`--verify-share`): not a token's pace
            chunks = s.times[1 : -2 if s.checked else -1]
            with lock:
                paces.append((chunks[-1] - chunks[0]) / (len(chunks) - 1))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        return statuses, paces, len(paces)

    # The model's sessions: its serving providers' batch slots. The broker may place both
    # stages on one provider (the other standing by) or one stage on each, as their profiles say.
    model = call(b.http, "GET", "/v1/models/tiny-llama", ADMIN)[2]
    serving = {p["peer_id"] for stage in model["stages"] for p in stage["providers"]}
    assert 1 <= len(serving) <= providers, model
    slots = max_batch * len(serving)
    run(4)  # sessions' first steps (warm-up) are not the reference's

    def reference() -> float:  # the slots' pace alone
        statuses, paces_ref, done_ref = run(slots)
        assert statuses == [200] * slots and done_ref == slots
        return statistics.median(paces_ref)

    before = reference()
    statuses, paces, done = run(200)
    assert set(statuses) <= {200, 429}, sorted(set(statuses))
    admitted = statuses.count(200)
    assert admitted >= slots, admitted
    assert done == admitted  # every accepted stream completed
    # The reference is taken before and after the burst, and the slower counts: this
    # machine's other work (under `-n 2`, the other worker's test) can halve its speed for
    # tens of seconds, which a reference taken at another moment does not see.
    after = reference()
    # A stream's pace, not single gaps: chunks reach the client in uneven gaps (0, one step,
    # two steps) whose median flips between modes from run to run.
    p50_ref, p50 = max(before, after), statistics.median(paces)
    print(json.dumps({"slots": slots, "admitted": admitted, "p50_ref_ms": [before * 1e3,
        after * 1e3], "p50_ms": p50 * 1e3}))  # fmt: skip
    assert p50 <= 1.5 * p50_ref, (p50, before, after)
