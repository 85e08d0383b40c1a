"""A minimal broker stand-in for the provider tests, run as its own process.

It speaks the broker's side of join, heartbeat, ping and stage status, serves one model
package's files over HTTP by SHA-256 (with range requests), and assigns stages when told on
stdin. Everything it sees is printed on stdout as JSON lines, for the test to wait on.

    python tests/test_provider/standin.py --package DIR [--cut SHA:BYTES] [--token T]
    stdin:  {"cmd": "assign", "peer": ID, "key": K, "stage": 1, "role": "active"}
            {"cmd": "unassign", "peer": ID, "key": K} | {"cmd": "promote", ...}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from p2p import Host, HostConfig, verify
from proto.assign import ASSIGN, STAGE_STATUS, Assign, Promote, StageStatus, StatusAck, Unassign
from proto.heartbeat import HEARTBEAT, Heartbeat, HeartbeatAck
from proto.join import (
    JOIN,
    JOIN_DOMAIN,
    MAX_CLOCK_SKEW_S,
    Join,
    JoinProfile,
    JoinReply,
    Leave,
    LeaveAck,
    signed_join_bytes,
)
from proto.ping import PING, Ping, Pong


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "t": time.time(), **fields}, default=str), flush=True)


class StandIn:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.package = Path(args.package)
        self.members: set[str] = set()
        self.cut: dict[str, int] = {}
        for spec in args.cut or []:
            sha, _, nbytes = spec.partition(":")
            self.cut[sha] = int(nbytes)
        self.host: Host | None = None

    # ---- p2p -------------------------------------------------------------------------------

    async def on_join(self, peer: str, msg: Join | Leave) -> JoinReply | LeaveAck:
        if isinstance(msg, Leave):
            self.members.discard(peer)
            emit("leave", peer=peer, reason=msg.reason)
            return LeaveAck()
        assert self.host is not None
        signed = signed_join_bytes(msg.profile, msg.broker, msg.timestamp)
        reason = ""
        if msg.broker != self.host.peer_id:
            reason = "this join is signed for another broker"
        elif abs(time.time() - msg.timestamp) > MAX_CLOCK_SKEW_S:
            reason = "the join's timestamp is too far from the broker's clock"
        elif not verify(peer, signed, msg.signature, domain=JOIN_DOMAIN):
            reason = "bad signature"
        elif self.args.token and msg.token != self.args.token:
            reason = "a valid join token is required"
        if reason:
            emit("join_refused", peer=peer, reason=reason)
            return JoinReply(accepted=False, reason=reason)
        profile = msgspec.json.decode(msg.profile, type=JoinProfile)
        self.members.add(peer)
        emit("join", peer=peer, profile=msgspec.to_builtins(profile), loaded=msg.loaded)
        return JoinReply(accepted=True, pool="backup", heartbeat_s=self.args.heartbeat_s)

    async def on_heartbeat(self, peer: str, msg: Heartbeat) -> HeartbeatAck:
        known = peer in self.members
        emit(
            "heartbeat",
            peer=peer,
            seq=msg.seq,
            loaded=msg.loaded,
            known=known,
            draining=msg.draining,
            queued=msg.queued,
        )
        return HeartbeatAck(known=known)

    async def on_ping(self, peer: str, msg: Ping) -> Pong:
        return Pong(nonce=msg.nonce, payload=msg.payload)

    async def on_status(self, peer: str, msg: StageStatus) -> StatusAck:
        emit(
            "status",
            peer=peer,
            key=msg.key,
            state=msg.state,
            role=msg.role,
            reason=msg.reason,
            load_s=msg.load_s,
        )
        return StatusAck()

    # ---- http ------------------------------------------------------------------------------

    async def artifact(self, request: web.Request) -> web.StreamResponse:
        sha = request.match_info["sha"]
        manifest = json.loads((self.package / "manifest.json").read_bytes())
        files = {s["sha256"]: s["file"] for s in manifest["stages"]}
        if sha not in files:
            raise web.HTTPNotFound(text="no such artifact")
        data = (self.package / files[sha]).read_bytes()
        start = 0
        rng = request.headers.get("Range", "")
        if rng.startswith("bytes="):
            start = int(rng[6:].split("-")[0])
        emit("http_get", sha=sha, start=start)
        resp = web.StreamResponse(status=206 if start else 200)
        resp.content_length = len(data) - start
        if start:
            resp.headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        await resp.prepare(request)
        cut = self.cut.pop(sha, None)
        body = data[start:]
        if cut is not None:
            await resp.write(body[:cut])
            await asyncio.sleep(0.2)
            assert request.transport is not None
            request.transport.close()  # the connection drops mid-download
            emit("http_cut", sha=sha, sent=cut)
            return resp
        await resp.write(body)
        await resp.write_eof()
        return resp

    # ---- commands --------------------------------------------------------------------------

    async def commands(self, http_base: str) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        manifest = (self.package / "manifest.json").read_bytes()
        shas = [s["sha256"] for s in json.loads(manifest)["stages"]]
        while line := await reader.readline():
            if not line.strip():
                continue
            cmd = json.loads(line)
            assert self.host is not None
            msg: Assign | Unassign | Promote
            if cmd["cmd"] == "assign":
                sha = cmd.get("sha", shas[cmd["stage"]])
                body = cmd.get("manifest", manifest.decode()).encode()
                msg = Assign(
                    key=cmd["key"],
                    manifest=body,
                    stage=cmd["stage"],
                    url=f"{http_base}/v1/artifacts/{sha}",
                    role=cmd.get("role", "active"),
                )
            elif cmd["cmd"] == "unassign":
                msg = Unassign(key=cmd["key"])
            else:
                msg = Promote(key=cmd["key"])
            try:
                ack = await self.host.request(cmd["peer"], ASSIGN, msg, timeout=10.0)
                emit("assign_ack", key=cmd["key"], accepted=ack.accepted, reason=ack.reason)
            except Exception as exc:
                emit("assign_error", key=cmd["key"], error=str(exc))

    async def run(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/artifacts/{sha}", self.artifact)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        http_base = f"http://127.0.0.1:{port}"
        listen = (f"/ip4/127.0.0.1/tcp/{self.args.port}",)
        config = HostConfig(listen=listen, data_dir=Path(self.args.data_dir))
        async with Host(config) as host:
            self.host = host
            host.add_control_handler(JOIN, self.on_join)
            host.add_control_handler(HEARTBEAT, self.on_heartbeat)
            host.add_control_handler(PING, self.on_ping)
            host.add_control_handler(STAGE_STATUS, self.on_status)
            emit("ready", addr=host.addrs[0], peer_id=host.peer_id, http=http_base)
            await self.commands(http_base)
        await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--package", required=True)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--heartbeat-s", type=float, default=0.5)
    parser.add_argument("--token")
    parser.add_argument("--port", type=int, default=0, help="p2p port (0: any)")
    parser.add_argument("--cut", action="append", help="SHA:BYTES: cut the first GET of SHA")
    asyncio.run(StandIn(parser.parse_args()).run())


if __name__ == "__main__":
    main()
