"""The dashboard in headless Chromium against a live broker with providers: the swarm map
(every provider, a layer range for each stage, a provider's death within the heartbeat timeout
plus 2 s), the live charts (a model's tokens/s during a generation, 0 when idle), the
playground (a streamed greedy completion equal to the SDK's, sent with Tab and Enter alone),
phone width, a dark colour scheme, a hostile hardware name, and an API key asked before
anything is shown. Driven over the Chrome DevTools Protocol (a websocket), with a screenshot
of each view saved. Under CI=true a missing Chromium fails."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import shutil
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.test_broker.conftest import HEARTBEAT_S, BrokerProc, add_model, wait_joined, wait_ready

pytestmark = pytest.mark.timeout(180)

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--remote-debugging-port=0",
    "--window-size=1400,1000",
]


def chromium() -> str:
    found = next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p),
        None,
    )
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("Chromium is missing: CI installs Debian's chromium (see .ci/run)")
        pytest.skip("Chromium is not installed (apt-get install chromium)")
    return found


class Page:
    """One browser tab over the DevTools protocol."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.next_id = 0
        self.events: list[dict[str, Any]] = []  # what the page told us unasked (dialogs, ...)

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        await self.ws.send_json({"id": self.next_id, "method": method, "params": params})
        while True:
            msg = await asyncio.wait_for(self.ws.receive_json(), 30)
            if "method" in msg:
                self.events.append(msg)
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise AssertionError(f"{method}: {msg['error']}")
                result: dict[str, Any] = msg["result"]
                return result

    async def eval(self, expression: str) -> Any:
        out = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in out:
            raise AssertionError(f"{expression}: {out['exceptionDetails']}")
        return out["result"].get("value")

    async def wait(self, what: str, expression: str, timeout: float = 30.0) -> Any:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            value = await self.eval(expression)
            if value:
                return value
            await asyncio.sleep(0.2)
        html = await self.eval("document.body.innerText")
        thrown = [e["params"] for e in self.events if e["method"] == "Runtime.exceptionThrown"]
        raise AssertionError(
            f"page never showed {what} in {timeout} s; its errors: {thrown}; it shows:\n{html}"
        )


async def open_page(tmp_path: Path) -> AsyncIterator[Page]:
    proc = await asyncio.create_subprocess_exec(
        chromium(),
        *FLAGS,
        f"--user-data-dir={tmp_path / 'chromium'}",
        "about:blank",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stderr is not None
        port = None
        while port is None:
            line = (await asyncio.wait_for(proc.stderr.readline(), 30)).decode()
            if not line:
                break
            found = re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", line)
            port = int(found.group(1)) if found else None
        assert port is not None, "Chromium did not open its DevTools port"
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/json/list") as resp:
                targets = await resp.json(content_type=None)
            target = next(t for t in targets if t["type"] == "page")
            async with http.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                yield Page(ws)
    finally:
        proc.kill()
        await proc.wait()


HOSTILE = "<img src=x onerror=alert(1)>"
VIEWS = ("map", "charts", "jobs", "play", "events")


async def press(page: Page, key: str) -> None:
    codes = {"Tab": 9, "Enter": 13}
    down: dict[str, Any] = {"key": key, "code": key, "windowsVirtualKeyCode": codes[key]}
    if key == "Enter":
        down["text"] = "\r"
    await page.call("Input.dispatchKeyEvent", type="keyDown", **down)
    await page.call("Input.dispatchKeyEvent", type="keyUp", key=key, code=key)


async def tab_to(page: Page, element_id: str) -> None:
    """Press Tab until `element_id` has the focus (as a keyboard user would)."""
    for _ in range(30):
        await press(page, "Tab")
        if await page.eval("document.activeElement?.id") == element_id:
            return
    raise AssertionError(f"Tab never reached #{element_id}")


async def screenshot(page: Page, folder: Path, name: str) -> Path:
    shot = await page.call("Page.captureScreenshot", format="png")
    path = folder / f"dashboard-{name}.png"
    path.write_bytes(base64.b64decode(shot["data"]))
    assert path.stat().st_size > 5_000, f"{name}: an empty screenshot"
    return path


async def generate_for(fa: Any, seconds: float, start: float, times: list[float]) -> None:
    """Greedy generations one after the other for `seconds` after `start`, each token's time
    kept in `times`."""
    while time.monotonic() - start < seconds:
        gen = await fa.generate("Count with me:", 200, stream=False, model="tiny-llama")
        times.extend(gen.token_times)


async def chart_latest(page: Page, chart: str, series: str) -> float | None:
    value = await page.eval(
        f'document.querySelector(\'[data-chart="{chart}"] .legend '
        f'[data-series="{series}"]\')?.dataset.latest ?? null'
    )
    return float(value) if value not in (None, "") else None


async def test_dashboard_map_charts_playground_phone_dark_and_keys(
    broker: Callable[..., BrokerProc],
    provider: Callable[..., Any],
    llama_package: Path,
    tmp_path: Path,
) -> None:
    from client import AsyncClient

    chromium()
    folder = Path(os.environ.get("FUSIONAI_SCREENSHOTS", tmp_path))
    folder.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 (before anything runs)
    b = broker("--metrics-every-s", "0.5")
    procs = [provider(b.addr) for _ in range(2)]
    peers = [p.wait_for("listening", timeout=60)["peer_id"] for p in procs]
    # a third provider whose hardware name is markup: it must show as text, run nothing
    hostile_dir = tmp_path / "hostile"
    hostile_dir.mkdir()
    profile = json.loads((tmp_path / "provider-1" / "profile.json").read_text())
    profile.update(cpu=HOSTILE, gpu=None)
    (hostile_dir / "profile.json").write_text(json.dumps(profile))
    procs.append(provider(b.addr, data_dir=hostile_dir))
    peers.append(procs[-1].wait_for("listening", timeout=60)["peer_id"])
    wait_joined(b.http, peers)
    add_model(b.http, llama_package)
    route = wait_ready(b.http, "tiny-llama")
    async with aiohttp.ClientSession() as http, http.get(b.http + "/") as resp:
        assert resp.headers["Content-Security-Policy"].startswith("default-src 'self'")
    async for page in open_page(tmp_path):
        await page.call("Page.enable")
        await page.call("Runtime.enable")
        await page.call("Page.navigate", url=b.http + "/")
        await page.wait(
            "the live feed", "document.querySelector('#conn')?.dataset.state === 'live'"
        )

        # The map: every provider, a layer range for each stage, who serves it.
        for peer in peers:
            await page.wait(
                f"provider {peer}", f"!!document.querySelector('.card[data-peer=\"{peer}\"]')"
            )
        stages = route["stages"]
        for stage in stages:
            first, end = stage["layers"]
            shown = await page.wait(
                f"stage {stage['key']}",
                f"document.querySelector('.segment[data-stage=\"{stage['key']}\"]')?.innerText",
            )
            assert f"layers {first}–{end - 1}" in shown
            assert (
                await page.eval(
                    f"document.querySelector('.segment[data-stage=\"{stage['key']}\"]').dataset.layers"
                )
                == f"{first}-{end - 1}"
            )
            for p in stage["providers"]:
                assert p["peer_id"][-10:] in shown
        assert [s["layers"] for s in stages] == [[0, 2], [2, 4]]  # the 4 blocks, split in two
        hardware = (
            f"document.querySelector('.card[data-peer=\"{peers[2]}\"] .hardware').textContent"
        )
        assert await page.eval(hardware) == HOSTILE
        assert await page.eval("document.querySelectorAll('main img').length") == 0
        await screenshot(page, folder, "map")

        # The charts: a model's tokens/s during a generation, as the SDK saw it, within 20 %.
        await page.call("Page.navigate", url=b.http + "/#charts")
        await page.wait("the charts", "!!document.querySelector('[data-chart=\"tokens\"] svg')")
        async with AsyncClient(b.http, cache_dir=tmp_path / "cache", timeout=60) as fa:
            await fa.generate("warm up", 2, stream=False, model="tiny-llama")
            readings: list[float] = []
            times: list[float] = []
            start = time.monotonic()

            task = asyncio.create_task(generate_for(fa, 7.0, start, times))
            while not task.done():
                await asyncio.sleep(0.25)
                value = await chart_latest(page, "tokens", "tiny-llama")
                if time.monotonic() - start > 2.5 and value is not None:
                    readings.append(value)  # (rates are over the last second or two)
            await task
            rate = len(times) / (times[-1] - start)
            shown = sum(readings) / len(readings)
            print(f"tokens/s: the chart {shown:.1f} (mean of {len(readings)}), the SDK {rate:.1f}")
            assert len(readings) >= 10 and abs(shown - rate) <= 0.2 * rate, (shown, rate, readings)
            await screenshot(page, folder, "charts")
            idle = await page.wait(
                "the idle model at 0 tokens/s",
                'document.querySelector(\'[data-chart="tokens"] .legend '
                "[data-series=\"tiny-llama\"]')?.dataset.latest === '0'",
                timeout=10,
            )
            assert idle
            expected = await fa.generate("Hello swarm", 12, stream=False, model="tiny-llama")

        # The playground: Tab and Enter only; the text equals the SDK's greedy text.
        await page.call("Page.navigate", url=b.http + "/#play")
        await page.wait(
            "the models", "document.querySelector('#play-model')?.value === 'tiny-llama'"
        )
        await page.eval("document.querySelector('#play-max').value = '12'; true")
        await tab_to(page, "play-prompt")
        await page.call("Input.insertText", text="Hello swarm")
        await tab_to(page, "play-send")
        await press(page, "Enter")
        await page.wait(
            "the streamed answer", "document.querySelector('#play-out')?.dataset.done === 'true'"
        )
        assert await page.eval("document.querySelector('#play-out').textContent") == expected.text
        rows = await page.eval("document.querySelectorAll('#play-tokens tbody tr').length")
        assert rows == len(expected.tokens)
        chips = await page.eval(
            "document.querySelectorAll('#play-tokens tbody tr:first-child .chip').length"
        )
        assert chips == len(stages)
        await screenshot(page, folder, "play")

        # A provider that dies: the map shows it within the heartbeat timeout plus 2 s.
        await page.call("Page.navigate", url=b.http + "/#map")
        await page.wait("the map", "document.querySelectorAll('.card').length === 3")
        victim = stages[0]["providers"][0]["peer_id"]
        killed = time.monotonic()
        next(p for p, peer in zip(procs, peers, strict=True) if peer == victim).signal(
            signal.SIGKILL
        )
        await page.wait(
            "the provider lost",
            f"document.querySelector('.card[data-peer=\"{victim}\"]')?.dataset.pool === 'dead'",
            timeout=30,
        )
        # within the heartbeat timeout (3 missed heartbeats, the broker's default) plus 2 s
        assert time.monotonic() - killed <= 3 * HEARTBEAT_S + 2.0
        await page.wait(
            "the failover note", "document.querySelector('#failovers')?.innerText.includes('lost')"
        )
        await page.call("Page.navigate", url=b.http + "/#events")
        await page.wait(
            "the event log",
            "document.querySelector('#events')?.innerText.includes('provider_lost')",
        )

        # Phone width: no view scrolls sideways; then the dark colour scheme.
        await page.call(
            "Emulation.setDeviceMetricsOverride",
            width=390,
            height=844,
            deviceScaleFactor=1,
            mobile=True,
        )
        for view in VIEWS:
            await page.call("Page.navigate", url=f"{b.http}/#{view}")
            await page.wait(
                f"the {view} view", f"document.querySelector('#view-{view}')?.hidden === false"
            )
            await asyncio.sleep(0.3)
            wide = await page.eval("[document.documentElement.scrollWidth, window.innerWidth]")
            assert wide[0] <= wide[1], f"{view} scrolls sideways at 390 px: {wide}"
            await screenshot(page, folder, f"{view}-390px")
        await page.call(
            "Emulation.setEmulatedMedia",
            features=[{"name": "prefers-color-scheme", "value": "dark"}],
        )
        await page.call("Page.navigate", url=f"{b.http}/#map")
        await page.wait("the dark map", "document.querySelectorAll('.card').length === 3")
        rgb = await page.eval("getComputedStyle(document.body).backgroundColor")
        red, green, blue = (int(v) for v in re.findall(r"\d+", rgb)[:3])
        assert 0.2126 * red + 0.7152 * green + 0.0722 * blue < 60, rgb
        await screenshot(page, folder, "map-dark")
        assert not [e for e in page.events if e["method"] == "Page.javascriptDialogOpening"]

        # A broker with API keys: nothing is shown before the key is given.
        key = "fai-dashboard-key-0123456789"
        keyed = broker("--api-key", key, data_dir=tmp_path / "keyed")
        await page.call("Page.navigate", url=keyed.http + "/")
        await page.wait("the key prompt", "document.querySelector('#keyform')?.hidden === false")
        assert await page.eval("document.querySelector('#conn').textContent") == "API key needed"
        assert await page.eval("document.querySelector('#main').hidden")
        assert await page.eval("document.querySelector('#nav').hidden")
        await page.eval(
            f"document.querySelector('#key').value = {json.dumps(key)};"
            "document.querySelector('#keyform').requestSubmit(); true"
        )
        await page.wait(
            "the live feed", "document.querySelector('#conn')?.dataset.state === 'live'"
        )
        await page.wait("an empty swarm", "document.body.innerText.includes('no providers')")


async def test_a_training_job_s_page_shows_progress_story_and_loss_curve(
    tmp_path: Path, pretrain_package: Path
) -> None:
    """A pre-training run on an in-process swarm (a real broker, its HTTP API and SQLite):
    its page in the dashboard has its state, progress, story and a point a step on the loss
    curve."""
    from ir.scratch import SHIPPED_DATA, read_texts
    from tests.test_broker.inproc import swarm

    chromium()
    steps = 6
    s = await swarm(tmp_path / "swarm")
    try:
        for _ in range(2):
            await s.provider()
        model = await s.add_model(pretrain_package)
        await s.until("a route", lambda: all(s.broker.serving.route(model) or [[]]), 60)
        body = {"kind": "train", "model": model, "texts": read_texts(SHIPPED_DATA)[:20],
                "batch": 12, "seq_len": 32, "steps": steps}  # fmt: skip
        job = await s.broker.jobs.submit(body)
        row = await s.until(
            "the run's end",
            lambda: (r := s.broker.store.job(job.id, full=False)) and r.state == "succeeded" and r,
            180,
        )
        assert row.state == "succeeded"
        async for page in open_page(tmp_path):
            await page.call("Page.enable")
            await page.call("Page.navigate", url=f"{s.broker.http_url}/#jobs")
            link = f'#jobs a[href="#job/{job.id}"]'
            await page.wait("the job's row", f"!!document.querySelector('{link}')")
            await page.eval(f"document.querySelector('{link}').click(); true")
            curve = 'document.querySelector(\'#job [data-chart="loss"] path[data-series="loss"]\')'
            points = await page.wait("the loss curve", f"{curve}?.dataset.points")
            assert int(points) == steps
            text = await page.eval("document.querySelector('#job').innerText")
            assert "succeeded" in text and "train_step" in text and f"{model}" in text
            folder = Path(os.environ.get("FUSIONAI_SCREENSHOTS", tmp_path))
            await screenshot(page, folder, "job")
    finally:
        await s.close()
