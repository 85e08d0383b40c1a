"""Measurements inside the lab, run in its namespaces (each prints one JSON line):

python -m lab.probe serve PORT                # UDP echo and a TCP sink on PORT
python -m lab.probe rtt HOST PORT [-n 20]     # UDP round trips: median and spread, ms
python -m lab.probe bulk HOST PORT BYTES      # TCP upload; the sink reports Mbit/s
python -m lab.probe pull HOST PORT BYTES      # TCP download from the server: Mbit/s
python -m lab.probe dial HOST PORT            # a TCP connect: {"ok": bool, "error": ...}
python -m lab.probe mapping STUN1 STUN2       # one UDP socket's public address as two
                                              # STUN servers see it (same port: cone)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import sys
import threading
import time


def serve(port: int) -> None:
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("0.0.0.0", port))
    tcp = socket.socket()
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind(("0.0.0.0", port))
    tcp.listen()

    def echo() -> None:
        while True:
            data, source = udp.recvfrom(2048)
            udp.sendto(data, source)

    def sink(conn: socket.socket) -> None:
        """Count what arrives and print the rate from first to last byte (an upload), or
        send the bytes asked for (a download: "D" and a size)."""
        mode = conn.recv(1)
        if mode == b"D":
            _send(conn, struct.unpack("!Q", _exactly(conn, 8))[0])
            conn.close()
            return
        rate = _receive(conn)
        conn.close()
        print(json.dumps(rate), flush=True)

    threading.Thread(target=echo, daemon=True).start()
    print(json.dumps({"ready": port}), flush=True)
    while True:
        conn, _ = tcp.accept()
        threading.Thread(target=sink, args=(conn,), daemon=True).start()


def _exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed early")
        data += chunk
    return data


def _send(conn: socket.socket, size: int) -> None:
    block, sent = os.urandom(1 << 16), 0
    while sent < size:
        sent += conn.send(block[: min(len(block), size - sent)])


def _receive(conn: socket.socket) -> dict[str, float]:
    """Read until the other side closes: bytes, and the rate from first to last byte."""
    total, first, last = 0, 0.0, 0.0
    while chunk := conn.recv(1 << 16):
        last = time.monotonic()
        if not total:
            first = last
        total += len(chunk)
    seconds = max(last - first, 1e-9)
    return {"bytes": total, "seconds": seconds, "mbit_s": total * 8 / seconds / 1e6}


def pull(host: str, port: int, size: int) -> dict[str, float]:
    s = socket.create_connection((host, port), timeout=30)
    s.sendall(b"D" + struct.pack("!Q", size))
    return _receive(s)


def rtt(host: str, port: int, n: int) -> dict[str, float]:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(2.0)
    s.connect((host, port))
    times = []
    for i in range(n + 2):  # the first two warm the neighbour tables up
        start = time.monotonic()
        s.send(struct.pack("!I", i) + b"x" * 60)
        while struct.unpack("!I", s.recv(2048)[:4])[0] != i:
            pass
        if i >= 2:
            times.append((time.monotonic() - start) * 1e3)
        time.sleep(0.02)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times)}


def bulk(host: str, port: int, size: int) -> dict[str, float]:
    s = socket.create_connection((host, port), timeout=30)
    s.sendall(b"U")
    start = time.monotonic()
    _send(s, size)
    s.shutdown(socket.SHUT_WR)
    s.recv(1)  # until the sink closes: everything arrived
    return {"bytes": size, "seconds": time.monotonic() - start}


def dial(host: str, port: int) -> dict[str, object]:
    try:
        socket.create_connection((host, port), timeout=3).close()
    except OSError as exc:
        return {"ok": False, "error": type(exc).__name__}
    return {"ok": True}


def mapping(servers: list[str], port: int = 3478) -> dict[str, object]:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", 0))
    s.settimeout(2.0)
    seen = []
    for server in servers:
        tid = os.urandom(12)
        s.sendto(struct.pack("!HHI", 1, 0, 0x2112A442) + tid, (server, port))
        while True:
            data, _ = s.recvfrom(2048)
            if data[8:20] == tid:
                break
        _, _, _, _, mport, raw = struct.unpack("!HHBBHI", data[20:32])  # MAPPED-ADDRESS first
        seen.append(f"{socket.inet_ntoa(struct.pack('!I', raw))}:{mport}")
    return {"local_port": s.getsockname()[1], "mapped": seen}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.probe")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve").add_argument("port", type=int)
    r = sub.add_parser("rtt")
    r.add_argument("host")
    r.add_argument("port", type=int)
    r.add_argument("-n", type=int, default=20)
    b = sub.add_parser("bulk")
    b.add_argument("host")
    b.add_argument("port", type=int)
    b.add_argument("size", type=int)
    pl = sub.add_parser("pull")
    pl.add_argument("host")
    pl.add_argument("port", type=int)
    pl.add_argument("size", type=int)
    d = sub.add_parser("dial")
    d.add_argument("host")
    d.add_argument("port", type=int)
    m = sub.add_parser("mapping")
    m.add_argument("servers", nargs="+")
    args = parser.parse_args(argv)
    if args.command == "serve":
        serve(args.port)
        return 0
    out: object
    if args.command == "rtt":
        out = rtt(args.host, args.port, args.n)
    elif args.command == "bulk":
        out = bulk(args.host, args.port, args.size)
    elif args.command == "pull":
        out = pull(args.host, args.port, args.size)
    elif args.command == "dial":
        out = dial(args.host, args.port)
    else:
        out = mapping(args.servers)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
