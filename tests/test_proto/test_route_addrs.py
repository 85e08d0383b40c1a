"""A chained step's route carries each hop's addresses compactly (`proto.session.hop_addrs`)
and the provider passing the step on dials them whole (`dial_addrs`)."""

from __future__ import annotations

from proto.session import dial_addrs, hop_addrs

PEER = "12D3KooWNBEPYE8pKeSfByNSdiLoaydimrgBUSDZrtVjjeJTf4F4"
RELAY = "12D3KooWJ6BW9SocU41549QRbtujnRAnGPxmsZCoVpLVGZGVk2op"


def test_a_route_drops_the_peer_suffix_and_loopback_and_the_dialler_restores_the_suffix() -> None:
    announced = [  # as a provider behind a UPnP router announces itself, and a relayed one
        f"/ip4/203.0.113.103/tcp/4800/p2p/{PEER}",
        f"/ip4/10.3.0.2/tcp/4800/p2p/{PEER}",
        f"/ip4/127.0.0.1/tcp/4800/p2p/{PEER}",
        f"/ip4/198.51.100.7/tcp/4001/p2p/{RELAY}/p2p-circuit/p2p/{PEER}",
    ]
    carried = hop_addrs(PEER, announced)
    assert carried == [
        "/ip4/203.0.113.103/tcp/4800",
        "/ip4/10.3.0.2/tcp/4800",
        f"/ip4/198.51.100.7/tcp/4001/p2p/{RELAY}/p2p-circuit",
    ]
    assert sum(map(len, carried)) < sum(map(len, announced)) / 2
    assert dial_addrs(PEER, carried) == [a for a in announced if "/127.0.0.1/" not in a]
    # a provider only on loopback (every process on one machine) keeps it; addresses that
    # came whole (an older client) are dialled as they are
    alone = [f"/ip4/127.0.0.1/tcp/4800/p2p/{PEER}", f"/ip6/::1/tcp/4800/p2p/{PEER}"]
    assert hop_addrs(PEER, alone) == ["/ip4/127.0.0.1/tcp/4800", "/ip6/::1/tcp/4800"]
    assert dial_addrs(PEER, alone) == alone
    assert hop_addrs(PEER, []) == [] == dial_addrs(PEER, [])
