"""Hole punching on one machine, where there is no NAT to punch through (the lab's
test_punch has real ones and the direct connections): a relay's control port tells a
connection from our listening port where it came from, and a punch that cannot be tried (no
public address, or a peer that does not punch) leaves the relayed connection working."""

from __future__ import annotations

import pytest

from p2p import Host, RemoteError
from p2p.punch import PUNCH, Ack, Connect, PunchConfig, Puncher, observe
from p2p.relay import RelayClient, RelayServer
from p2p.testing import ECHO_CONTROL, LOCAL, Echo, serve_test_protocols

pytestmark = pytest.mark.timeout(60)


def port_of(host: Host) -> int:
    return int(host.addrs[0].split("/")[4])


async def test_the_relay_says_where_a_connection_from_our_listening_port_comes_from() -> None:
    relay = RelayServer("127.0.0.1", 0)
    await relay.start()
    try:
        async with Host(LOCAL) as host:
            port = port_of(host)
            seen = await observe(port, ("127.0.0.1", relay.port), timeout=10)
            assert seen == f"/ip4/127.0.0.1/tcp/{port}"
    finally:
        await relay.close()


async def test_without_a_public_address_the_peers_stay_on_the_relayed_connection() -> None:
    relay = RelayServer("127.0.0.1", 0)
    await relay.start()
    try:
        async with Host(LOCAL) as server, Host(LOCAL) as client:
            serve_test_protocols(server)
            endpoint = ("127.0.0.1", relay.port)
            Puncher(server)  # it knows no observer, so no public address of its own
            puncher = Puncher(client)
            held = RelayClient(server.identity, endpoint, ("127.0.0.1", port_of(server)))
            assert await client.connect(await held.reserve()) == server.peer_id
            relayed = [f"/ip4/127.0.0.1/tcp/{held.port}"]
            assert puncher.remote_addrs(server.peer_id) == relayed
            punched = await puncher.punch(server.peer_id)
            assert punched.direct is None and "no public address" in punched.reason, punched
            answer = await client.request(server.peer_id, ECHO_CONTROL, Echo(n=1), timeout=10)
            assert answer.n == 2 and puncher.remote_addrs(server.peer_id) == relayed
            await held.close()
    finally:
        await relay.close()


async def test_a_peer_can_only_make_us_dial_the_ip_its_relayed_connection_came_from() -> None:
    relay = RelayServer("127.0.0.1", 0)
    await relay.start()
    try:
        async with Host(LOCAL) as server, Host(LOCAL) as client:
            endpoint = ("127.0.0.1", relay.port)
            held = RelayClient(server.identity, endpoint, ("127.0.0.1", port_of(server)))
            Puncher(server, lambda: endpoint, origin=held.origin)
            Puncher(client)
            peer = await client.connect(await held.reserve())
            ok = await client.request(peer, PUNCH, Connect(addr="/ip4/127.0.0.1/tcp/9"))
            assert isinstance(ok, Ack)
            with pytest.raises(RemoteError, match="not where your connection comes from"):
                await client.request(peer, PUNCH, Connect(addr="/ip4/192.0.2.1/tcp/9"))
            await held.close()
    finally:
        await relay.close()


async def test_a_peer_that_does_not_punch_stays_on_the_connection_it_has() -> None:
    async with Host(LOCAL) as server, Host(LOCAL) as client:
        serve_test_protocols(server)
        puncher = Puncher(client, config=PunchConfig(message_timeout=5))
        await client.connect(server.addrs[0])
        before = puncher.remote_addrs(server.peer_id)
        punched = await puncher.punch(server.peer_id)
        assert punched.direct is None and "does not punch" in punched.reason
        assert puncher.remote_addrs(server.peer_id) == before
