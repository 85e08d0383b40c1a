"""`fusionai demo`: start two peers as separate processes, connect them, measure a round trip.

Each peer has its own identity in a temporary data directory. The first serves pings; the
second dials it over Noise and yamux and measures round trips. Both processes are stopped and
the directories removed on exit, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STARTUP_TIMEOUT = 60.0  # seconds a peer may take to start listening


def _peer_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "cli.main", "p2p", *args]


def _wait_for_line(proc: subprocess.Popen[str], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line:
            return line
        if proc.poll() is not None:
            break
    raise RuntimeError(f"the serving peer did not start (exit code {proc.poll()})")


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="fusionai-demo-") as tmp:
        server_dir, client_dir = Path(tmp, "peer-a"), Path(tmp, "peer-b")
        if not args.json:
            print("starting peer A (serves pings) ...", flush=True)
        server = subprocess.Popen(
            _peer_command(
                "serve", "--json", "--listen", "/ip4/127.0.0.1/tcp/0", "--data-dir", str(server_dir)
            ),
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            hello = json.loads(_wait_for_line(server, STARTUP_TIMEOUT))
            if not args.json:
                print(f"peer A {hello['peer_id']} listens on {hello['addrs'][0]}", flush=True)
                print("starting peer B, dialling A over Noise + yamux ...", flush=True)
            ping = subprocess.run(
                _peer_command(
                    "ping",
                    hello["addrs"][0],
                    "--json",
                    "--count",
                    str(args.count),
                    "--data-dir",
                    str(client_dir),
                ),
                capture_output=True,
                text=True,
                timeout=120,
            )
            if ping.returncode != 0:
                print(f"error: peer B failed: {ping.stderr.strip()}", file=sys.stderr)
                return 1
            result = json.loads(ping.stdout)
        finally:
            server.terminate()
            try:
                server.wait(timeout=15)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    summary = {
        "peer_a": hello["peer_id"],
        "peer_b": result["peer_id"],
        "connect_ms": result["connect_ms"],
        "pings": result["pings"],
        "rtt_p50_ms": result["rtt_p50_ms"],
        "rtt_p99_ms": result["rtt_p99_ms"],
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            f"\npeer A: {summary['peer_a']}\npeer B: {summary['peer_b']}\n"
            f"connected in {summary['connect_ms']} ms; round trip over {summary['pings']} pings: "
            f"p50 {summary['rtt_p50_ms']} ms, p99 {summary['rtt_p99_ms']} ms"
        )
    return 0
