"""A userspace Ethernet link between two network namespaces that adds one-way latency.

This kernel has no `netem`, so the lab's access links delay frames here: the process creates
a TAP device in each namespace (`python -m lab.link NS_A DEV_A NS_B DEV_B --delay-ms 25`),
prints `ready`, and forwards every frame read from one device to the other `delay` later, in
order. Bandwidth is the kernel's business (`tc tbf` on the devices). The devices disappear
when the process exits (they are not persistent), so killing it tears the link down.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import heapq
import os
import selectors
import struct
import sys
import time
from pathlib import Path

CLONE_NEWNET = 0x40000000
TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
MAX_FRAME = 65536
QUEUE_LIMIT = 4096  # frames in flight per direction; more are dropped, as a full link drops


def enter(namespace: str) -> None:
    """Move this thread into network namespace `namespace` (one made by `ip netns add`)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fd = os.open(Path("/run/netns") / namespace, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({namespace}): {os.strerror(err)}")
    finally:
        os.close(fd)


def tap(name: str) -> int:
    """A TAP device `name` in the current namespace; its file descriptor (non-blocking)."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def forward(a: int, b: int, delay_s: float) -> None:
    """Forward frames a -> b and b -> a, each `delay_s` after it was read, until killed."""
    sel = selectors.DefaultSelector()
    sel.register(a, selectors.EVENT_READ, b)
    sel.register(b, selectors.EVENT_READ, a)
    due: list[tuple[float, int, int, bytes]] = []  # (when, sequence, to fd, frame)
    queued = {a: 0, b: 0}
    seq = 0
    while True:
        timeout = max(0.0, due[0][0] - time.monotonic()) if due else None
        for key, _ in sel.select(timeout):
            src, dst = key.fd, key.data
            while True:
                try:
                    frame = os.read(src, MAX_FRAME)
                except BlockingIOError:
                    break
                if queued[dst] >= QUEUE_LIMIT:
                    continue
                seq += 1
                queued[dst] += 1
                heapq.heappush(due, (time.monotonic() + delay_s, seq, dst, frame))
        now = time.monotonic()
        while due and due[0][0] <= now:
            _, _, dst, frame = heapq.heappop(due)
            queued[dst] -= 1
            try:
                os.write(dst, frame)
            except (BlockingIOError, OSError):
                pass  # the device is down or full: the frame is lost, as on a wire


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.link", description=__doc__)
    parser.add_argument("ns_a")
    parser.add_argument("dev_a")
    parser.add_argument("ns_b")
    parser.add_argument("dev_b")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one way (default 0)")
    args = parser.parse_args(argv)
    enter(args.ns_a)
    a = tap(args.dev_a)
    enter(args.ns_b)
    b = tap(args.dev_b)
    print("ready", flush=True)
    try:
        forward(a, b, args.delay_ms / 1e3)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
