"""The SDK and the `fusionai job` commands through a broker that restarts, drops connections
and answers 502/503: calls are tried again with backoff within their budget, a wait goes on
once the broker is back, results come once each, a job submission is never sent twice, and
giving up is one typed error (one line from the CLI).

The broker here is a stand-in for its job API on a real aiohttp server on 127.0.0.1, which
the test stops (every open connection cut, as when the process is killed) and starts again on
the same port; the SDK and the CLI are the product's own. `test_broker_restart.py` does the
same with a real broker and provider (slow)."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from tests.procs import ROOT, fusionai
from tests.test_broker.conftest import free_port

pytestmark = pytest.mark.timeout(30)

ROWS = 25  # result rows of every job
STEPS = 3  # status requests until a job has succeeded


class FakeBroker:
    """The broker's job routes on a real HTTP server. `faults[route]` are the next answers
    of that route to break: "drop" (the connection is cut before any answer), "drop-after"
    (the request is carried out, then the connection is cut), or a status such as 503."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.jobs: dict[str, int] = {}  # job id -> microbatches done
        self.hits: Counter[str] = Counter()  # route -> requests received
        self.faults: dict[str, list[str | int]] = {}
        self.hold = asyncio.Event()  # set: long polls are held until the server stops
        self.held = asyncio.Event()  # set when a long poll is held
        self._runner: web.AppRunner | None = None
        self._transports: set[Any] = set()

    async def start(self) -> None:
        app = web.Application(middlewares=[self._track])
        app.router.add_post("/v1/jobs", self._submit)
        app.router.add_get("/v1/jobs", self._list)
        app.router.add_get("/v1/jobs/{id}", self._job)
        app.router.add_get("/v1/jobs/{id}/results", self._results)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        """Down as a killed process is: every connection cut, the port closed."""
        for transport in list(self._transports):
            transport.abort()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @web.middleware
    async def _track(self, request: web.Request, handler: Any) -> web.StreamResponse:
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "?"
        self.hits[route] += 1
        self._transports.add(request.transport)
        pending = self.faults.get(route)
        fault = pending.pop(0) if pending else None
        if fault == "drop":
            assert request.transport is not None
            request.transport.abort()
            return web.Response()  # never sent: the connection is gone
        if isinstance(fault, int):
            return web.json_response({"error": {"message": f"fault {fault}"}}, status=fault)
        response = await handler(request)
        if fault == "drop-after":
            assert request.transport is not None
            request.transport.abort()
        return response

    def _view(self, job_id: str) -> dict[str, Any]:
        done = self.jobs[job_id]
        return {
            "id": job_id, "kind": "embed", "model": "m", "microbatches": STEPS, "done": done,
            "state": "succeeded" if done >= STEPS else "running", "progress": done / STEPS,
            "created": 0.0, "updated": 0.0, "error": None,
        }  # fmt: skip

    async def _submit(self, request: web.Request) -> web.Response:
        await request.json()
        job_id = f"job{len(self.jobs) + 1}"
        self.jobs[job_id] = 0
        return web.json_response(self._view(job_id), status=201)

    async def _list(self, request: web.Request) -> web.Response:
        return web.json_response({"jobs": [self._view(j) for j in self.jobs]})

    async def _job(self, request: web.Request) -> web.Response:
        job_id = request.match_info["id"]
        if "wait" in request.query and self.hold.is_set():
            self.held.set()
            await asyncio.Event().wait()  # held until the server is stopped under it
        self.jobs[job_id] = min(self.jobs[job_id] + 1, STEPS)
        return web.json_response(self._view(job_id))

    async def _results(self, request: web.Request) -> web.Response:
        offset, limit = int(request.query["offset"]), int(request.query["limit"])
        rows = [[float(i), 0.5] for i in range(offset, min(offset + limit, ROWS))]
        return web.json_response({"job": request.match_info["id"], "offset": offset,
                                  "total": ROWS, "embeddings": rows})  # fmt: skip

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": []})


EXPECTED = np.array([[float(i), 0.5] for i in range(ROWS)], dtype=np.float32)


def _client(broker: FakeBroker, retry_s: float = 10.0) -> Any:
    from client import AsyncClient
    from client.http import Backoff

    fa = AsyncClient(broker.url, timeout=10, retry_s=retry_s)
    fa._http.backoff = Backoff(first_s=0.05, max_s=0.3, jitter_s=0.05)
    return fa


async def test_a_wait_and_its_results_ride_through_a_restart_once_each() -> None:
    broker = FakeBroker()
    await broker.start()
    async with _client(broker) as fa:
        job = await fa.submit({"model": "m", "texts": ["a"]})
        broker.hold.set()  # the next long poll is in flight when the broker dies
        waiting = asyncio.ensure_future(fa.wait(job.id, poll=5))
        await asyncio.wait_for(broker.held.wait(), 10)
        await broker.stop()
        await asyncio.sleep(0.5)  # down: connections refused
        assert not waiting.done()
        broker.hold.clear()
        await broker.start()  # back on the same port
        done = await asyncio.wait_for(waiting, 10)
        assert done.state == "succeeded"
        # a page whose connection is cut, then one answered 502, are asked for again
        broker.faults["/v1/jobs/{id}/results"] = ["drop", 502]
        rows = await fa.results(job.id, page=10)
        assert rows.shape == (ROWS, 2) and np.array_equal(rows, EXPECTED)  # no row twice
        assert broker.hits["/v1/jobs/{id}/results"] == 3 + 2
    assert broker.hits["/v1/jobs"] == 1 and len(broker.jobs) == 1
    await broker.stop()


async def test_a_submission_is_tried_again_only_when_it_was_not_sent() -> None:
    from client import BrokerUnreachable

    broker = FakeBroker()
    async with _client(broker) as fa:
        later = asyncio.get_running_loop().call_later(
            0.4, lambda: asyncio.ensure_future(broker.start())
        )
        job = await fa.submit({"model": "m", "texts": ["a"]})  # refused until the broker is up
        assert job.id == "job1" and len(broker.jobs) == 1
        later.cancel()
        broker.faults["/v1/jobs"] = ["drop-after"]  # queued, then the connection is cut
        with pytest.raises(BrokerUnreachable, match="may have been queued") as gone:
            await fa.submit({"model": "m", "texts": ["b"]})
        assert gone.value.sent and len(broker.jobs) == 2 and broker.hits["/v1/jobs"] == 2
        broker.faults["/v1/jobs"] = ["drop"]  # cut before the broker acted: still not resent
        with pytest.raises(BrokerUnreachable):
            await fa.submit({"model": "m", "texts": ["c"]})
        assert broker.hits["/v1/jobs"] == 3 and len(broker.jobs) == 2
        assert [j.id for j in await fa.jobs()] == ["job1", "job2"]
    await broker.stop()


async def test_errors_a_retry_cannot_mend_come_at_once_and_giving_up_is_one_typed_error() -> None:
    from client import BadRequestError, BrokerUnreachable, UnavailableError

    broker = FakeBroker()
    await broker.start()
    async with _client(broker, retry_s=0.8) as fa:
        broker.faults["/v1/models"] = [503, 502, 504]
        assert await fa.models() == []
        assert broker.hits["/v1/models"] == 4
        broker.faults["/v1/models"] = [400]
        with pytest.raises(BadRequestError):
            await fa.models()
        assert broker.hits["/v1/models"] == 5  # not tried again
        broker.faults["/v1/models"] = [503] * 1000
        start = time.monotonic()
        with pytest.raises(UnavailableError):
            await fa.models()
        # (it gives up once the next pause would end past retry_s: after at least the first
        # pause, 0.2 s, however the random jitter fell)
        assert 0.2 <= time.monotonic() - start < 3 and broker.hits["/v1/models"] > 7
    await broker.stop()
    async with _client(broker, retry_s=0.8) as fa:
        start = time.monotonic()
        with pytest.raises(BrokerUnreachable, match=r"tried \d+ times over") as gone:
            await fa.models()
        assert 0.2 <= time.monotonic() - start < 3 and not gone.value.sent
    async with _client(broker, retry_s=0) as fa:
        start = time.monotonic()
        with pytest.raises(BrokerUnreachable) as gone:
            await fa.models()
        assert time.monotonic() - start < 1 and "tried" not in str(gone.value)


async def _cli(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *fusionai(*args), cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_job_submit_wait_rides_through_a_restart_or_gives_up_in_one_line(
    tmp_path: Path,
) -> None:
    texts = tmp_path / "texts.txt"
    texts.write_text("a\nb\n")
    broker = FakeBroker()
    await broker.start()
    broker.hold.set()
    submit = ("job", "submit", "--model", "m", "--texts", str(texts), "--wait", "--json")
    run = asyncio.ensure_future(_cli(*submit, "--broker", broker.url, "--timeout", "15"))
    await asyncio.wait_for(broker.held.wait(), 15)  # the first status, then a long poll
    await broker.stop()
    await asyncio.sleep(1.0)
    broker.hold.clear()
    await broker.start()
    rc, out, err = await run
    assert rc == 0, err
    assert json.loads(out)["state"] == "succeeded" and "Traceback" not in err
    assert len(broker.jobs) == 1

    broker.held.clear()
    broker.hold.set()  # the next job's broker never comes back
    start = time.monotonic()
    run = asyncio.ensure_future(_cli(*submit, "--broker", broker.url, "--timeout", "3"))
    await asyncio.wait_for(broker.held.wait(), 15)
    await broker.stop()
    rc, out, err = await run
    assert rc == 1 and out == "" and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot reach the broker"), err
    assert "--timeout" in lines[0] and time.monotonic() - start < 3 + 5
