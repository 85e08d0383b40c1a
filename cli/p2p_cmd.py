"""`fusionai p2p ...`: identity, a ping server and a ping client."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import time
from pathlib import Path

from p2p import Host, HostConfig, Identity, P2PError, default_data_dir
from proto.ping import PING, Ping, Pong


def _data_dir(args: argparse.Namespace) -> Path:
    return Path(args.data_dir) if args.data_dir else default_data_dir()


def identity(args: argparse.Namespace) -> int:
    try:
        with Identity.load_or_create(_data_dir(args)) as ident:
            info = {"peer_id": ident.peer_id, "key_file": str(ident.key_path)}
    except P2PError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(info))
    else:
        print(f"peer id:  {info['peer_id']}\nkey file: {info['key_file']}")
    return 0


async def _on_ping(peer_id: str, ping: Ping) -> Pong:
    return Pong(nonce=ping.nonce, payload=ping.payload)


async def _serve(args: argparse.Namespace) -> int:
    listen = tuple(args.listen) if args.listen else HostConfig().listen
    config = HostConfig(listen=listen, data_dir=_data_dir(args))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with Host(config) as host:
        host.add_control_handler(PING, _on_ping)
        if args.json:
            print(json.dumps({"peer_id": host.peer_id, "addrs": host.addrs}), flush=True)
        else:
            print(f"peer id {host.peer_id}, listening on:", flush=True)
            for addr in host.addrs:
                print(f"  {addr}", flush=True)
        await stop.wait()
    return 0


def serve(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_serve(args))
    except P2PError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


async def _ping(args: argparse.Namespace) -> dict[str, object]:
    config = HostConfig(listen=("/ip4/127.0.0.1/tcp/0",), data_dir=_data_dir(args))
    async with Host(config) as host:
        started = time.perf_counter()
        remote = await host.connect(args.addr)
        connect_ms = (time.perf_counter() - started) * 1e3
        payload = b"\x00" * args.size
        await host.request(remote, PING, Ping(nonce=0, payload=payload))  # opens the stream
        rtts = []
        for nonce in range(1, args.count + 1):
            t0 = time.perf_counter()
            pong = await host.request(remote, PING, Ping(nonce=nonce, payload=payload))
            rtts.append((time.perf_counter() - t0) * 1e3)
            if pong.nonce != nonce:
                raise P2PError(f"pong {pong.nonce} answered ping {nonce}")
        rtts.sort()
        return {
            "peer_id": host.peer_id,
            "remote_peer_id": remote,
            "connect_ms": round(connect_ms, 2),
            "pings": args.count,
            "payload_bytes": args.size,
            "rtt_p50_ms": round(statistics.median(rtts), 3),
            "rtt_p99_ms": round(rtts[min(len(rtts) - 1, int(len(rtts) * 0.99))], 3),
        }


def ping(args: argparse.Namespace) -> int:
    if args.count < 1:
        print("error: --count must be at least 1", file=sys.stderr)
        return 2
    try:
        result = asyncio.run(_ping(args))
    except (P2PError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{result['peer_id']} -> {result['remote_peer_id']}: connected in "
            f"{result['connect_ms']} ms; {result['pings']} pings, round trip "
            f"p50 {result['rtt_p50_ms']} ms, p99 {result['rtt_p99_ms']} ms"
        )
    return 0
