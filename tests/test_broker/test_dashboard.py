"""The dashboard in headless Chromium against a live broker with providers: it lists them,
shows the model's route, and updates when a provider leaves. Driven over the Chrome DevTools
Protocol (a websocket), with a screenshot saved. Under CI=true a missing Chromium fails."""

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

from tests.test_broker.conftest import BrokerProc, add_model, wait_joined, wait_ready

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

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        await self.ws.send_json({"id": self.next_id, "method": method, "params": params})
        while True:
            msg = await asyncio.wait_for(self.ws.receive_json(), 30)
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
        raise AssertionError(f"page never showed {what} in {timeout} s; it shows:\n{html}")


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


async def test_dashboard_lists_providers_and_updates_when_one_leaves(
    broker: Callable[..., BrokerProc],
    provider: Callable[..., Any],
    minilm_package: Path,
    tmp_path: Path,
) -> None:
    chromium()
    b = broker()
    procs = [provider(b.addr) for _ in range(2)]
    peers = [p.wait_for("listening", timeout=60)["peer_id"] for p in procs]
    wait_joined(b.http, peers)
    add_model(b.http, minilm_package)
    wait_ready(b.http, "minilm")
    async for page in open_page(tmp_path):
        await page.call("Page.enable")
        await page.call("Page.navigate", url=b.http + "/")
        await page.wait(
            "the live feed", "document.querySelector('#conn')?.dataset.state === 'live'"
        )
        for peer in peers:
            await page.wait(
                f"provider {peer}",
                f"document.querySelector('tr[data-peer=\"{peer}\"] td.pool')?.textContent "
                f"=== 'active'",
            )
        route = await page.wait(
            "the model's route", "document.querySelector('[data-model=\"minilm\"]')?.innerText"
        )
        assert "minilm/1" in route and "minilm/2" in route and "no route" not in route
        assert await page.eval("document.querySelectorAll('#events li').length") > 0
        checks = f"document.querySelector('tr[data-peer=\"{peers[1]}\"] td.checks')?.textContent"
        assert await page.eval(checks) == "none yet"  # its reputation: no answer checked yet

        procs[0].signal(signal.SIGKILL)  # one provider leaves: the page shows it lost
        shown = await page.wait(
            "the provider lost",
            f"document.querySelector('tr[data-peer=\"{peers[0]}\"]')?.dataset.pool === 'dead'"
            f" && document.body.innerText",
            timeout=30,
        )
        assert "provider_lost" in shown
        shot = await page.call("Page.captureScreenshot", format="png")
        path = Path(os.environ.get("FUSIONAI_SCREENSHOTS", tmp_path)) / "dashboard.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(shot["data"]))
        assert path.stat().st_size > 10_000

        # A broker with API keys: the page asks for one, then goes live with it.
        key = "fai-dashboard-key-0123456789"
        keyed = broker("--api-key", key, data_dir=tmp_path / "keyed")
        await page.call("Page.navigate", url=keyed.http + "/")
        await page.wait("the key prompt", "document.querySelector('#keyform')?.hidden === false")
        assert await page.eval("document.querySelector('#conn').textContent") == "API key needed"
        await page.eval(
            f"document.querySelector('#key').value = {json.dumps(key)};"
            "document.querySelector('#keyform').requestSubmit(); true"
        )
        await page.wait(
            "the live feed", "document.querySelector('#conn')?.dataset.state === 'live'"
        )
        await page.wait("an empty swarm", "document.body.innerText.includes('no providers')")
