"""A classic STUN server (RFC 3489 binding requests, with CHANGE-REQUEST) on the lab's
Internet: `python -m lab.stun IP1 IP2 [--port 3478 --alt-port 3479]`.

It answers each binding request with the address the request came from (MAPPED-ADDRESS and
XOR-MAPPED-ADDRESS), sent from the address and port the request's CHANGE-REQUEST asks for.
Hosts and routers learn their public address and NAT behaviour from it: the lab's UPnP router
(miniupnpd refuses documentation addresses on its WAN unless STUN shows it is reachable).
"""

from __future__ import annotations

import argparse
import selectors
import socket
import struct
import sys

MAGIC = 0x2112A442
BINDING_REQUEST, BINDING_RESPONSE = 0x0001, 0x0101
MAPPED, CHANGE, XOR_MAPPED, CHANGED_ADDRESS = 0x0001, 0x0003, 0x0020, 0x0005


def address_attr(kind: int, ip: str, port: int, xor: bool) -> bytes:
    raw = struct.unpack("!I", socket.inet_aton(ip))[0]
    if xor:
        port ^= MAGIC >> 16
        raw ^= MAGIC
    return struct.pack("!HHBBHI", kind, 8, 0, 1, port, raw)


def answer(
    request: bytes, source: tuple[str, int], changed: tuple[str, int]
) -> tuple[bytes, int] | None:
    """(response, change flags) for a binding request; None for anything else."""
    if len(request) < 20:
        return None
    kind, length = struct.unpack("!HH", request[:4])
    if kind != BINDING_REQUEST or len(request) < 20 + length:
        return None
    flags, pos = 0, 20
    while pos + 4 <= 20 + length:
        attr, size = struct.unpack("!HH", request[pos : pos + 4])
        if attr == CHANGE and size == 4:
            flags = struct.unpack("!I", request[pos + 4 : pos + 8])[0]
        pos += 4 + size + (-size % 4)
    body = (
        address_attr(MAPPED, *source, xor=False)
        + address_attr(XOR_MAPPED, *source, xor=True)
        + address_attr(CHANGED_ADDRESS, *changed, xor=False)
    )
    return struct.pack("!HH", BINDING_RESPONSE, len(body)) + request[4:20] + body, flags


def serve(ips: tuple[str, str], ports: tuple[int, int]) -> None:
    socks: dict[tuple[int, int], socket.socket] = {}
    sel = selectors.DefaultSelector()
    for i, ip in enumerate(ips):
        for j, port in enumerate(ports):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind((ip, port))
            socks[(i, j)] = s
            sel.register(s, selectors.EVENT_READ, (i, j))
    print("ready", flush=True)
    while True:
        for key, _ in sel.select():
            i, j = key.data
            data, source = socks[(i, j)].recvfrom(2048)
            reply = answer(data, source, (ips[1 - i], ports[1 - j]))
            if reply is None:
                continue
            response, flags = reply
            out = socks[(1 - i if flags & 0x4 else i, 1 - j if flags & 0x2 else j)]
            out.sendto(response, source)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.stun", description=__doc__)
    parser.add_argument("ip1")
    parser.add_argument("ip2")
    parser.add_argument("--port", type=int, default=3478)
    parser.add_argument("--alt-port", type=int, default=3479)
    args = parser.parse_args(argv)
    try:
        serve((args.ip1, args.ip2), (args.port, args.alt_port))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
