"""The HTTP gateway with real processes: OpenAI-style embeddings and completions (sent by the
`openai` package itself), job events as SSE, /metrics, API keys, TLS, limits and bad input."""

from __future__ import annotations

import http.client
import json
import re
import signal
import ssl
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.procs import Proc
from tests.procs import sample_texts as texts
from tests.test_broker.conftest import (
    BrokerProc,
    add_model,
    api,
    documented,
    local_embeddings,
    wait_joined,
    wait_ready,
    wait_until,
)

pytestmark = pytest.mark.timeout(300)
openai = pytest.importorskip("openai")

Spawner = Callable[..., Any]


def local_greedy(package: Path, prompt: str, steps: int) -> tuple[list[int], str]:
    """Greedy tokens (stopping after end-of-sequence) and their text, in this process."""
    from client.stages import ClientStages
    from ir.executors.ort import OrtExecutor
    from ir.package import load_package
    from ir.pipeline import LocalPipeline
    from tests.test_ir.test_split import wire_hop

    pkg = load_package(package)
    stages = ClientStages(package)
    ids = stages.tokenizer.encode(prompt).ids
    executors = [OrtExecutor(pkg.models[s.index]) for s in pkg.manifest.stages]
    pipeline = LocalPipeline(pkg.manifest, executors, hop=wire_hop(pkg.manifest))
    tokens = pipeline.generate_greedy(ids, steps)
    if stages.eos in tokens:
        tokens = tokens[: tokens.index(stages.eos) + 1]
    return tokens, stages.tokenizer.decode(tokens, skip_special_tokens=True)


def local_sampled(
    package: Path, prompt: list[int], steps: int, temperature: float, top_p: float, seed: int
) -> str:
    """Sampled generation in this process with the same sampler: the reference text."""
    from client.sampling import Sampler
    from client.stages import ClientStages
    from client.text import TextStream
    from ir.executors.ort import OrtExecutor
    from ir.package import load_package
    from ir.pipeline import LocalPipeline

    pkg = load_package(package)
    stages = ClientStages(package)
    pipe = LocalPipeline(
        pkg.manifest, [OrtExecutor(pkg.models[s.index]) for s in pkg.manifest.stages]
    )
    sampler, cache = Sampler(temperature, top_p, seed), pipe.new_cache()
    text = TextStream(stages.tokenizer, prefix=prompt)
    logits = pipe.step(np.array([prompt], dtype=np.int64), 0, cache)
    fed, out = len(prompt), ""
    for i in range(steps):
        token = sampler.pick(logits[0, -1])
        out += text.push(token)
        if token == stages.eos or i + 1 == steps:
            break
        logits = pipe.step(np.array([[token]], dtype=np.int64), fed, cache)
        fed += 1
    return out + text.finish()


def sse_events(
    http: str, path: str, headers: dict[str, str] | None = None
) -> list[tuple[str, Any]]:
    """(event, data) of a server-sent event stream, read to its end."""
    req = urllib.request.Request(http + path, headers=headers or {})
    out: list[tuple[str, Any]] = []
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        event = "message"
        for raw in resp:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                out.append((event, json.loads(line[6:])))
                event = "message"
    return out


def swarm_with(
    broker: Spawner, provider: Spawner, packages: list[Path], providers: int, *extra: str
) -> tuple[BrokerProc, list[Proc]]:
    b: BrokerProc = broker(*extra)
    procs = [provider(b.addr) for _ in range(providers)]
    wait_joined(b.http, [proc.wait_for("listening", timeout=60)["peer_id"] for proc in procs])
    for package in packages:
        name = add_model(b.http, package)["model"]
        wait_ready(b.http, name)
    return b, procs


def test_openai_embeddings_completions_streams_metrics_and_bad_input(
    broker: Spawner, provider: Spawner, minilm_package: Path, llama_package: Path
) -> None:
    b, _ = swarm_with(broker, provider, [minilm_package, llama_package], 4)
    client = openai.OpenAI(base_url=b.http + "/v1", api_key="unused", max_retries=0)
    sample = texts(5)

    # The models, as the openai package lists them (OpenAI's list shape).
    listed = client.models.list()
    assert sorted(m.id for m in listed.data) == ["minilm", "tiny-llama"]
    assert all(m.object == "model" and m.created > 1.7e9 for m in listed.data)
    # Answers are what the document says, field by field (the schemas of `proto/api/`).
    for path, template in [
        ("/v1/models", "/v1/models"),
        ("/v1/models/tiny-llama", "/v1/models/{name}"),
        ("/v1/swarm", "/v1/swarm"),
        ("/v1/providers", "/v1/providers"),
        ("/healthz", "/healthz"),
        ("/v1/jobs", "/v1/jobs"),
        ("/v1/events?limit=5", "/v1/events"),
        ("/v1/metrics/history", "/v1/metrics/history"),
    ]:
        documented(b.http, "GET", path, template)
    one = {"model": "minilm", "input": "x"}
    documented(b.http, "POST", "/v1/embeddings", "/v1/embeddings", one)
    once = {"model": "tiny-llama", "prompt": "Hi", "max_tokens": 2, "temperature": 0}
    assert documented(b.http, "POST", "/v1/completions", "/v1/completions", once)["object"] == (
        "text_completion"
    )

    # Embeddings: the package's default request (base64), and floats; both equal local MiniLM.
    expected = local_embeddings(minilm_package, sample)
    got = client.embeddings.create(model="minilm", input=sample)
    assert [d.index for d in got.data] == list(range(5))
    assert np.abs(np.array([d.embedding for d in got.data]) - expected).max() <= 1e-4
    assert got.usage.prompt_tokens > 5
    floats = client.embeddings.create(model="minilm", input=sample[0], encoding_format="float")
    assert np.abs(np.array(floats.data[0].embedding) - expected[0]).max() <= 1e-4

    # Completions: greedy text equals local generation, whole and streamed.
    tokens, text = local_greedy(llama_package, "Hello swarm", 12)
    done = client.completions.create(
        model="tiny-llama", prompt="Hello swarm", max_tokens=12, temperature=0
    )
    assert done.choices[0].text == text
    assert done.usage.completion_tokens == len(tokens)
    assert done.choices[0].finish_reason == ("stop" if len(tokens) < 12 else "length")
    chunks = list(
        client.completions.create(
            model="tiny-llama", prompt="Hello swarm", max_tokens=12, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == done.choices[0].finish_reason
    assert all(c.object == "text_completion" for c in chunks) and done.object == chunks[0].object
    # Asked for, each token's chunk says who ran its stages and how long it took.
    routed = list(
        client.completions.create(
            model="tiny-llama",
            prompt="Hello swarm",
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_route": True},  # type: ignore[typeddict-unknown-key]
        )
    )
    assert "".join(c.choices[0].text for c in routed) == text
    made = [x for c in routed if (x := (c.model_extra or {}).get("fusionai"))]
    assert len(made) == len(tokens), made
    assert all(len(m["providers"]) == 2 and m["ms"] > 0 for m in made)
    assert not any((c.model_extra or {}).get("fusionai") for c in chunks)  # (not asked for)
    # Token-id prompts, seeded sampling (repeatable), and a stop string.
    ids = [5, 17, 3, 9]
    by_ids = client.completions.create(
        model="tiny-llama", prompt=ids, max_tokens=6, temperature=0.8, top_p=0.9, seed=7
    )
    again = client.completions.create(
        model="tiny-llama", prompt=ids, max_tokens=6, temperature=0.8, top_p=0.9, seed=7
    )
    assert by_ids.choices[0].text == again.choices[0].text
    assert by_ids.choices[0].text == local_sampled(llama_package, ids, 6, 0.8, 0.9, 7)
    assert len(text) >= 6, text  # (a fixed model and prompt: this holds, so the next test runs)
    stop = text[3:5]
    cut = client.completions.create(
        model="tiny-llama", prompt="Hello swarm", max_tokens=12, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"

    # Bad input: clear errors naming the field, the right status, and the broker lives on.
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="x")
    for call, field in [
        (lambda: client.completions.create(model="tiny-llama", prompt="x", n=2), "n"),
        (lambda: client.completions.create(model="minilm", prompt="x"), "model"),
        (lambda: client.completions.create(model="tiny-llama", prompt="x", max_tokens=0), None),
        (lambda: client.embeddings.create(model="minilm", input=[]), "input"),
        (lambda: client.embeddings.create(model="tiny-llama", input="x"), "model"),
        (lambda: client.embeddings.create(model="minilm", input=[[99999999]]), "input"),
    ]:
        with pytest.raises(openai.BadRequestError) as bad:
            call()
        assert bad.value.status_code == 400
        if field is not None:
            assert bad.value.body["field"] == field, bad.value.body
    for raw, field in [
        (b"{not json", "body"),
        (b"[1, 2]", "body"),
        (json.dumps({"model": "minilm", "input": "x", "frobnicate": 1}).encode(), "frobnicate"),
        (json.dumps({"model": "minilm", "input": 3}).encode(), "input"),
        (json.dumps({"model": "tiny-llama", "prompt": "x", "temperature": "hot"}).encode(), None),
    ]:
        path = "/v1/completions" if b"prompt" in raw else "/v1/embeddings"
        status, out = api(b.http, "POST", path, raw=raw)
        assert status == 400, out
        assert field is None or out["error"]["field"] == field, out

    # Fuzzed bodies naming real models reach tokenizers, sessions and streams: never a 500.
    import random

    from tests.test_broker.test_api_contract import nasty_values

    rng = random.Random(99)
    for i in range(60):
        body = nasty_values(rng)
        if isinstance(body, dict):
            body["model"] = "tiny-llama" if i % 2 else "minilm"
            body.setdefault("prompt" if i % 2 else "input", nasty_values(rng))
            body.setdefault("max_tokens", 2)
        status, out = api(b.http, "POST", "/v1/completions" if i % 2 else "/v1/embeddings", body)
        assert status < 500, (body, out)

    # A job's progress and results as server-sent events.
    status, job = api(b.http, "POST", "/v1/jobs", {"model": "minilm", "texts": texts(20)})
    assert status == 201
    events = sse_events(b.http, f"/v1/jobs/{job['id']}/events")
    kinds = [e for e, _ in events]
    assert kinds[0] == "job_queued" and "job_succeeded" in kinds and kinds[-1] == "end"
    rows = [r for e, d in events if e == "results" for r in d["embeddings"]]
    assert np.abs(np.array(rows) - local_embeddings(minilm_package, texts(20))).max() <= 1e-4
    assert events[-1][1]["state"] == "succeeded"

    # Prometheus metrics reflect what happened.
    with urllib.request.urlopen(b.http + "/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    pools = dict(re.findall(r'fusionai_providers\{pool="(\w+)"\} (\S+)', metrics))
    # Every provider is in one pool; under heavy load one may have been declared lost for
    # missed heartbeats and be back as a backup, so only the total is exact.
    assert sum(float(n) for n in pools.values()) == 4.0, pools
    assert float(pools["active"]) >= 2.0, pools
    assert 'fusionai_job_outcomes_total{outcome="succeeded"} 1.0' in metrics
    generated = re.search(r'fusionai_generated_tokens_total\{model="tiny-llama"\} (\S+)', metrics)
    assert generated is not None and float(generated.group(1)) >= 2 * len(tokens) + 12
    assert 'fusionai_queue_length{model="minilm"} 0.0' in metrics
    assert "fusionai_stage_seconds_bucket" in metrics
    assert 'route="/v1/embeddings",status="200"' in metrics
    assert 'route="/v1/completions",status="400"' in metrics
    assert b.proc.proc.poll() is None


def test_generation_continues_on_the_backup_when_a_provider_dies(
    broker: Spawner, provider: Spawner, llama_package: Path
) -> None:
    b: BrokerProc = broker()
    procs = {}
    for _ in range(4):
        proc = provider(b.addr)
        procs[proc.wait_for("listening", timeout=60)["peer_id"]] = proc
    wait_joined(b.http, procs)
    add_model(b.http, llama_package)
    route = wait_ready(b.http, "tiny-llama", backups=1)
    victim_id = route["stages"][0]["providers"][0]["peer_id"]
    victim = procs[victim_id]
    _, text = local_greedy(llama_package, "Models travel as ONNX", 16)
    client = openai.OpenAI(base_url=b.http + "/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(
        model="tiny-llama",
        prompt="Models travel as ONNX",
        max_tokens=16,
        temperature=0,
        stream=True,
    )
    got = ""
    for n, chunk in enumerate(stream):
        got += chunk.choices[0].text
        if n == 2:  # mid-answer: the provider serving the first stage dies
            victim.signal(signal.SIGKILL)
            assert victim.proc.wait(timeout=10) != 0
    assert got == text
    assert n >= 4, "the answer should go on after the provider died"
    moved = b.proc.wait_for("session_failover", lambda e: e["peer"] == victim_id, timeout=10)
    assert moved["stage"] == route["stages"][0]["key"]


def test_api_keys_tls_body_limit_and_provider_downloads(
    broker: Spawner, provider: Spawner, minilm_package: Path, tmp_path: Path
) -> None:
    key = "fai-test-key-0123456789"
    keys_file = tmp_path / "keys"
    admin = "fai-test-admin-key-0123456789"
    keys_file.write_text(f"# team keys\n{key} alice\n{admin} admin ops\n")
    b: BrokerProc = broker(
        "--api-keys-file", str(keys_file), "--tls-self-signed", "--max-body-mb", "1"
    )
    assert b.http.startswith("https://")
    cert = tmp_path / "broker" / "tls" / "cert.pem"
    trusted = ssl.create_default_context(cafile=str(cert))

    def call(path: str, key: str | None = None, data: bytes | None = None) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        if data is not None:
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(b.http + path, data=data, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=30, context=trusted) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    assert call("/healthz")[0] == 200  # public
    assert json.loads(call("/openapi.json")[1])["paths"]["/v1/completions"]
    assert call("/")[0] == 200  # the dashboard page itself; its feed needs the key
    for path in ("/v1/swarm", "/v1/stream", "/metrics", "/v1/models"):
        status, body = call(path)
        assert status == 401, path
        assert "API key" in json.loads(body)["error"]["message"]
    assert call("/v1/swarm", "wrong-key-0123456789")[0] == 401
    assert call("/v1/swarm", key)[0] == 200
    with pytest.raises(urllib.error.URLError):  # the certificate is not trusted by default
        urllib.request.urlopen(b.http + "/healthz", timeout=10)
    status, body = call("/v1/jobs", key, b"[" + b"1," * 600_000 + b"1]")
    assert status == 413, body
    status, body = call("/v1/jobs", key, b"{")
    assert status == 400 and json.loads(body)["error"]["field"] == "body"

    # Providers fetch artifacts over HTTPS (pinning the certificate) with a token, no key.
    p = provider(b.addr)
    p.wait_for("listening", timeout=60)
    provider(b.addr).wait_for("listening", timeout=60)
    env_cli = ["--api-key", admin, "--cacert", str(cert)]  # (adding a model: an admin key)
    add_model(b.http, minilm_package, *env_cli)
    status, body = call("/v1/models/minilm", key)
    assert status == 200
    wait_until(
        "minilm served over https",
        lambda: json.loads(call("/v1/models/minilm", key)[1])["ready"],
        timeout=90,
    )
    sha = json.loads((minilm_package / "manifest.json").read_text())["stages"][1]["sha256"]
    other = json.loads((minilm_package / "manifest.json").read_text())["stages"][2]["sha256"]
    from broker.auth import ArtifactTokens

    peer = json.loads(call("/v1/providers", key)[1])["providers"][0]["peer_id"]
    link = f"peer={peer}&token=" + ArtifactTokens(tmp_path / "broker").token(sha, peer)
    assert call(f"/v1/artifacts/{sha}")[0] == 401
    assert call(f"/v1/artifacts/{sha}?peer={peer}&token=0000")[0] == 401
    assert call(f"/v1/artifacts/{other}?{link}")[0] == 401  # a token names one artifact
    assert call(f"/v1/artifacts/{sha}?peer={peer}&token=%C3%A9%FF")[0] == 401
    status, body = call(f"/v1/artifacts/{sha}?{link}")  # (as the broker signs assignments)
    assert (
        status == 200
        and len(body)
        == json.loads((minilm_package / "manifest.json").read_text())["stages"][1]["size_bytes"]
    )
    raw = http.client.HTTPSConnection(b.http.split("//")[1], timeout=10, context=trusted)
    raw.putrequest("GET", "/v1/swarm")
    raw.putheader("X-API-Key", b"\xff\xfe not utf-8")
    raw.endheaders()
    assert raw.getresponse().status == 401
    client = openai.OpenAI(
        base_url=b.http + "/v1",
        api_key=key,
        max_retries=0,
        http_client=openai.DefaultHttpxClient(verify=trusted),
    )
    got = client.embeddings.create(model="minilm", input=texts(2))
    expected = local_embeddings(minilm_package, texts(2))
    assert np.abs(np.array([d.embedding for d in got.data]) - expected).max() <= 1e-4
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url=b.http + "/v1",
            api_key="wrong-key-0123456789",
            max_retries=0,
            http_client=openai.DefaultHttpxClient(verify=trusted),
        ).embeddings.create(model="minilm", input="x")
    b.proc.signal(signal.SIGTERM)
    assert b.proc.wait(timeout=30) == 0
