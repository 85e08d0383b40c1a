"""Secrets and roles on a live broker (in this process, its real HTTP server on 127.0.0.1, real
provider daemons downloading over it): owner-only data directories whatever the umask,
artifact links bound to one provider and a lifetime and never logged, admin keys for adding
models, and HTTP connections that send slowly or sit idle closed."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import stat
import time
from pathlib import Path

import aiohttp
import pytest

from broker.auth import ArtifactTokens, Keys, load_keys
from broker.openapi import document
from client import AsyncClient
from client.errors import AuthenticationError
from tests.test_broker.inproc import Swarm, host_of, swarm

pytestmark = pytest.mark.timeout(60)
USER = "fai-user-key-0123456789"
ADMIN = "fai-admin-key-0123456789"
RAW_TOKEN = re.compile(r"token=(?!REDACTED)[^&\s\"']")  # a link's token, shown


def loose(root: Path) -> list[str]:
    """What under `root` (itself included) group or others may read, write or enter."""
    found = [root, *(Path(d) / n for d, dirs, files in os.walk(root) for n in [*dirs, *files])]
    return [
        f"{p.relative_to(root.parent)} {stat.S_IMODE(p.lstat().st_mode):04o}"
        for p in found
        if not p.is_symlink() and stat.S_IMODE(p.lstat().st_mode) & 0o077
    ]


async def test_data_directories_are_owner_only_whatever_the_umask(
    tmp_path: Path, llama_package: Path, caplog: pytest.LogCaptureFixture
) -> None:
    old = tmp_path / "broker" / "models" / "old"  # a data directory an earlier release left
    old.mkdir(parents=True)  # open: 4 entries
    (old / "manifest.json").write_text("{}")
    for path, mode in ((tmp_path / "broker", 0o755), (old.parent, 0o755), (old, 0o755)):
        os.chmod(path, mode)
    os.chmod(old / "manifest.json", 0o644)
    (tmp_path / "broker" / "elsewhere").mkdir(mode=0o755)  # not the broker's: left alone
    mask = os.umask(0)  # (what every new file and folder would be given: all bits)
    try:
        with caplog.at_level(logging.WARNING, "files.private"):
            s: Swarm = await swarm(tmp_path, api_keys=(USER,))
        try:
            assert "4 files and folders in" in caplog.text and "owner-only" in caplog.text
            await s.provider()
            model = await s.add_model(llama_package)
            await s.until("a route", lambda: all(s.broker.serving.route(model) or [[]]))
            assert {"broker.db-wal", "broker.db-shm"} <= set(os.listdir(tmp_path / "broker"))
            assert loose(tmp_path / "broker") == ["broker/elsewhere 0755"]  # db, -wal, -shm,
            # secret, identity, models, artifacts: all owner-only
            assert loose(tmp_path / "provider-0") == []  # its artifact cache
        finally:
            await s.close()
    finally:
        os.umask(mask)


def test_artifact_tokens_name_one_artifact_for_one_provider_for_a_while(tmp_path: Path) -> None:
    now = [1e9]
    tokens = ArtifactTokens(tmp_path, lifetime_s=900.0, clock=lambda: now[0])
    sha, other = "a" * 64, "b" * 64
    token = tokens.token(sha, "peer-a", size=2 * 10**9)  # 15 min plus 2,000 s at 1 MB/s
    assert tokens.valid(sha, "peer-a", token)
    assert not tokens.valid(sha, "peer-b", token)  # bound to the provider it was made for
    assert not tokens.valid(other, "peer-a", token)  # and to one artifact
    assert not tokens.valid(sha, "peer-a", "9" * 12 + token[10:])  # a later expiry: forged
    assert not tokens.valid(sha, "peer-a", "²." + token.split(".")[1])
    now[0] += 900 + 2000
    assert tokens.valid(sha, "peer-a", token)
    now[0] += 1
    assert not tokens.valid(sha, "peer-a", token)  # expired
    again = ArtifactTokens(tmp_path, clock=lambda: now[0])  # the secret outlives a restart
    assert again.valid(sha, "peer-a", again.token(sha, "peer-a"))
    assert not again.valid(sha, "peer-a", token)


async def test_artifact_links_are_a_live_providers_own_and_never_logged(
    tmp_path: Path, llama_package: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    s: Swarm = await swarm(tmp_path, api_keys=(USER,), artifact_token_s=-3600.0)
    try:
        # Every link this broker gives expired an hour ago: the download fails (401).
        a = await s.provider()
        model = await s.add_model(llama_package)
        failed = await s.until("a failed load", lambda: s.events("stage_failed"))
        assert "HTTP 401" in failed[0]["reason"] and "token=REDACTED" in failed[0]["reason"]
        # Links that live: another provider downloads and serves the model.
        s.broker.tokens.lifetime_s = 900.0
        b = await s.provider()
        await s.until("a route", lambda: all(s.broker.serving.route(model) or [[]]))
        peer_a, peer_b = host_of(a).peer_id, host_of(b).peer_id
        stage = s.broker.serving.plans[model].model.manifest.stages[1]
        base = f"{s.broker.http_url}/v1/artifacts/{stage.sha256}"
        link = s.broker.tokens.token(stage.sha256, peer_b, stage.size_bytes)

        async with aiohttp.ClientSession() as http:

            async def get(query: str) -> tuple[int, str]:
                async with http.get(f"{base}?{query}") as resp:
                    body = await resp.read()
                    return resp.status, body.decode(errors="replace")[:300]

            assert (await get(f"peer={peer_b}&token={link}"))[0] == 200
            status, body = await get(f"peer={peer_a}&token={link}")  # another provider's
            assert status == 401 and "not this provider's" in body
            stranger = s.broker.tokens.token(stage.sha256, "12D3KooWStranger")
            assert (await get(f"peer=12D3KooWStranger&token={stranger}"))[0] == 401
            assert (await get(f"token={link}"))[0] == 401
            s.kill(b)  # a provider that has left: its link no longer works
            await s.elapse(16.0, b)
            assert (await get(f"peer={peer_b}&token={link}"))[0] == 401
        text = caplog.text + json.dumps([e.to_json() for e in s.broker.store.events(limit=10**5)])
        assert "token=REDACTED" in text  # links were logged (the provider's `assigned`), redacted
        assert not RAW_TOKEN.search(text), RAW_TOKEN.search(text)
        assert link not in text
    finally:
        await s.close()


async def test_only_admin_keys_add_models_and_upload_artifacts(
    tmp_path: Path, llama_package: Path
) -> None:
    s: Swarm = await swarm(tmp_path / "a", api_keys=(USER,), admin_keys=(ADMIN,))
    try:
        url = s.broker.http_url
        async with AsyncClient(url, USER) as user:
            with pytest.raises(AuthenticationError, match="needs an admin key"):
                await user.add_model(llama_package)
        async with AsyncClient(url, ADMIN) as admin:
            added = await admin.add_model(llama_package)
        async with aiohttp.ClientSession() as http:
            manifest = (llama_package / "manifest.json").read_bytes()
            for headers in ({"X-API-Key": USER}, {"Authorization": f"Bearer {USER}"}):
                async with http.post(f"{url}/v1/models", data=manifest, headers=headers) as r:
                    assert r.status == 403  # no replacing it either
                    assert "admin key" in (await r.json())["error"]["message"]
                async with http.get(f"{url}/v1/models/{added.model}", headers=headers) as r:
                    assert r.status == 200  # ordinary keys use models, in either header
            async with http.put(f"{url}/v1/artifacts/{'0' * 64}", data=b"x") as r:
                assert r.status == 401
    finally:
        await s.close()
    s = await swarm(tmp_path / "b", api_keys=(USER,))  # keys, but no admin key
    try:
        async with aiohttp.ClientSession() as http:
            headers = {"Authorization": f"Bearer {USER}"}
            put = f"{s.broker.http_url}/v1/artifacts/{'0' * 64}"
            async with http.put(put, data=b"x", headers=headers) as r:
                assert r.status == 403 and "--admin-key" in (await r.json())["error"]["message"]
    finally:
        await s.close()
    keys = tmp_path / "keys"
    keys.write_text(f"# team\n{USER} alice's laptop\n{ADMIN} admin (ops)\n")
    assert load_keys(keys) == ([USER], [ADMIN])
    assert Keys([USER], [ADMIN]).admin(ADMIN) and not Keys([USER], [ADMIN]).admin(USER)
    doc = document()
    assert set(doc["components"]["securitySchemes"]) == {"bearer", "apiKey"}
    assert doc["components"]["securitySchemes"]["apiKey"]["name"] == "X-API-Key"
    admin_ops = {
        (m.upper(), path) for path, ops in doc["paths"].items() for m, op in ops.items()
        if op.get("x-admin")
    }  # fmt: skip
    keys = {("GET", "/v1/keys"), ("POST", "/v1/keys"), ("DELETE", "/v1/keys/{id}")}
    assert admin_ops == {("POST", "/v1/models"), ("PUT", "/v1/artifacts/{sha}")} | keys
    assert doc["paths"]["/v1/models"]["post"]["responses"]["403"]


async def test_slow_and_idle_http_connections_are_closed(tmp_path: Path) -> None:
    s = await swarm(tmp_path, http_idle_s=0.5)
    try:
        host, port = s.broker.http_url.removeprefix("http://").split(":")

        async def closed_after(first: bytes, trickle: bool) -> float:
            """Seconds until the broker closes a connection that sent `first` and then
            (`trickle`) a header byte every 0.1 s."""
            reader, writer = await asyncio.open_connection(host, int(port))
            start = time.monotonic()
            writer.write(first)
            try:
                while True:
                    try:
                        got = await asyncio.wait_for(reader.read(65536), 0.1)
                    except TimeoutError:
                        if time.monotonic() - start > 5:
                            raise AssertionError("the connection is still open after 5 s") from None
                        if trickle:
                            writer.write(b"X")
                        continue
                    if not got:
                        return time.monotonic() - start
            finally:
                writer.close()

        slow = await closed_after(b"GET /healthz HTTP/1.1\r\nHost: broker\r\nX-Slow: ", True)
        assert 0.4 < slow < 3.0, slow
        idle = await closed_after(b"", False)
        assert 0.4 < idle < 3.0, idle
        # A whole request is answered; the connection then idles and is closed.
        after = await closed_after(b"GET /healthz HTTP/1.1\r\nHost: broker\r\n\r\n", False)
        assert 0.4 < after < 3.0, after
    finally:
        await s.close()
