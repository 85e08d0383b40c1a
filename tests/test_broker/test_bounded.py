"""Work per request is bounded before any tokenizing: a live broker (real process) with an
encoder and a decoder registered refuses a 60 MB string at once and stays near its memory
baseline; texts are refused or cut by their length in characters; invalid text and numbers
are 400s naming the field. `Admission` bounds requests, body bytes and tokens in progress."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from broker.admission import Admission, Limits, tokens_of_texts
from broker.errors import TooBusy
from tests.test_broker.conftest import BrokerProc, add_model

MB = 1024**2


@pytest.fixture(scope="module")
def live(
    tmp_path_factory: pytest.TempPathFactory, minilm_package: Path, llama_package: Path
) -> Iterator[BrokerProc]:
    from tests.procs import Proc, broker_command

    data = tmp_path_factory.mktemp("bounded-broker")
    proc = Proc(broker_command(data, port=0, http_port=0, heartbeat_s=0.5))
    try:
        started = proc.wait_for("broker_started", timeout=30)
        live = BrokerProc(proc, started["addrs"][0], started["http"])
        add_model(live.http, minilm_package)
        add_model(live.http, llama_package)
        yield live
    finally:
        proc.stop()


def post(http: str, path: str, raw: bytes) -> tuple[int, bytes, float]:
    """(status, body, seconds) of one POST of raw JSON."""
    request = urllib.request.Request(
        http + path, data=raw, method="POST", headers={"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read(), time.perf_counter() - start
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), time.perf_counter() - start


class PeakRss:
    """The largest resident size a process reaches while the block runs (sampled every 5 ms)."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.peak = 0
        self._done = threading.Event()

    def _sample(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            self._done.wait(0.005)

    def __enter__(self) -> PeakRss:
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._done.set()
        self._thread.join()


@pytest.mark.timeout(120)
def test_a_60_mb_string_is_refused_at_once_and_memory_stays_near_its_baseline(
    live: BrokerProc,
) -> None:
    # the encoder's client stages loaded (an id outside its vocabulary: refused after loading)
    status, body, _ = post(live.http, "/v1/embeddings", b'{"model":"minilm","input":[[999999]]}')
    assert status == 400, body
    process = psutil.Process(live.proc.proc.pid)
    baseline = process.memory_info().rss
    raw = b'{"model":"minilm","input":"' + b"hello " * (10 * MB) + b'"}'
    with PeakRss(live.proc.proc.pid) as rss:
        status, body, seconds = post(live.http, "/v1/embeddings", raw)
    del raw
    assert status == 400 and b'"field":"input"' in body, body[:300]
    assert seconds < 1.0, f"refused after {seconds:.2f} s"
    assert rss.peak - baseline < 200 * MB, f"peak {(rss.peak - baseline) / MB:.0f} MB over"
    after = process.memory_info().rss
    print(
        f"60 MB string: {status} in {seconds:.3f} s; RSS peak +{(rss.peak - baseline) / MB:.0f} MB"
        f", after +{(after - baseline) / MB:.0f} MB over a baseline of {baseline / MB:.0f} MB"
    )
    assert after - baseline < 200 * MB, f"{(after - baseline) / MB:.0f} MB still held"


@pytest.mark.timeout(60)
def test_a_prompt_longer_than_the_context_is_refused_before_tokenizing(live: BrokerProc) -> None:
    prompt = b"word " * 180_000  # 900,000 characters: within the API's limit on a text
    status, body, _ = post(
        live.http, "/v1/completions", b'{"model":"tiny-llama","prompt":"' + prompt + b'"}'
    )
    assert status == 400 and b'"field":"prompt"' in body, body[:300]
    assert b"characters: more than fit the model's context" in body, body[:300]


@pytest.mark.timeout(60)
def test_invalid_text_and_numbers_are_400s_naming_the_field(live: BrokerProc) -> None:
    for path, raw, field, words in [
        ("/v1/embeddings", rb'{"model":"minilm","input":"\ud800"}', b"body", b"surrogate"),
        ("/v1/jobs", rb'{"model":"minilm","texts":["a\udc00"]}', b"body", b"surrogate"),
        (
            "/v1/embeddings",
            b'{"model":"minilm","input":"x","dimensions":' + b"7" * 5000 + b"}",
            b"dimensions",
            b"out of range",
        ),
        (
            "/v1/completions",
            b'{"model":"tiny-llama","prompt":"x","temperature":1e999}',
            b"temperature",
            b"range",
        ),
    ]:
        status, body, _ = post(live.http, path, raw)
        assert status == 400, (path, raw[:80], body)
        assert field in body and words in body, (path, body)


def test_admission_counts_requests_bytes_and_tokens() -> None:
    admission = Admission(Limits(requests=2, body_bytes=100, tokens=1000))
    with admission.reading(80):
        with pytest.raises(TooBusy, match="bytes of requests"), admission.reading(30):
            pass
        with admission.working(600):
            with pytest.raises(TooBusy, match="tokens of work"), admission.working(500):
                pass
            with (
                admission.working(400),
                pytest.raises(TooBusy, match="requests are in progress"),
                admission.working(1),
            ):
                pass
    assert (admission.requests, admission.body_bytes, admission.tokens) == (0, 0, 0)
    with admission.working(5000):  # larger than the limit: admitted alone
        pass
    assert tokens_of_texts(["ab", "x" * 10_000], cap=512) == 4 + 512
