"""The relay on one machine: a relayed connection carries libp2p end to end (the relay sees no
plaintext), reservations must be signed by the peer and allowed, a relay answering itself
instead of forwarding fails the handshake, and the bandwidth cap holds."""

from __future__ import annotations

import asyncio
import time

import pytest

from p2p import Host, Identity, P2PError
from p2p.relay import RelayClient, RelayError, RelayServer
from p2p.testing import ECHO_CONTROL, LOCAL, Echo, serve_test_protocols

pytestmark = pytest.mark.timeout(60)


def port_of(host: Host) -> int:
    return int(host.addrs[0].split("/")[4])


async def test_a_relayed_connection_is_end_to_end_and_the_relay_reads_nothing() -> None:
    forwarded: list[bytes] = []
    relay = RelayServer("127.0.0.1", 0, seen=forwarded.append)
    await relay.start()
    async with Host(LOCAL) as server, Host(LOCAL) as client:
        serve_test_protocols(server)
        held = RelayClient(
            server.identity, ("127.0.0.1", relay.port), ("127.0.0.1", port_of(server))
        )
        addr = await held.reserve()
        assert relay.relayed_port(server.peer_id) == held.port and addr.endswith(server.peer_id)
        assert await client.connect(addr) == server.peer_id
        marker = b"MARKER-TENSOR-" * 500
        answer = await client.request(server.peer_id, ECHO_CONTROL, Echo(data=marker), timeout=10)
        assert answer.data == marker
        assert sum(map(len, forwarded)) > len(marker) and b"MARKER-TENSOR-" not in b"".join(
            forwarded
        )
        await held.close()
    await relay.close()


async def test_reservations_need_the_peers_signature_and_the_relays_consent() -> None:
    me = Identity.ephemeral()
    relay = RelayServer("127.0.0.1", 0, allowed=lambda peer, ticket: peer == me.peer_id)
    await relay.start()
    stranger = RelayClient(Identity.ephemeral(), ("127.0.0.1", relay.port), ("127.0.0.1", 9))
    with pytest.raises(RelayError, match="serves only the providers of its broker"):
        await stranger.reserve()
    reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
    challenge = (await reader.readline()).split()[1]
    forged = Identity.ephemeral().sign(b"whatever", domain="fusionai/relay/1")
    writer.write(f"RESERVE {me.peer_id} {forged.hex()}\n".encode())  # not signed by `me`
    assert b"does not prove that peer id" in await reader.readline() and challenge
    writer.close()
    assert relay.reservations == {}
    await relay.close()


async def test_a_relay_answering_itself_instead_of_forwarding_is_refused() -> None:
    """The 'relay' splices to another host of its own: the client wanted the provider's key,
    the Noise handshake shows another, and the connection is refused."""
    async with Host(LOCAL) as provider, Host(LOCAL) as impostor, Host(LOCAL) as client:
        relay = RelayServer("127.0.0.1", 0)
        await relay.start()
        # the impostor reserves, then its port is handed out as the provider's address
        held = RelayClient(impostor.identity, ("127.0.0.1", relay.port),
                           ("127.0.0.1", port_of(impostor)))  # fmt: skip
        await held.reserve()
        lie = f"/ip4/127.0.0.1/tcp/{held.port}/p2p/{provider.peer_id}"
        with pytest.raises((P2PError, ValueError)):
            await client.connect(lie)
        assert provider.peer_id not in client.connected_peers()
        await held.close()
        await relay.close()


async def test_the_relays_bandwidth_cap_holds() -> None:
    """200 KB/s with a second of burst: 300 KB each way take at least (600 - 200) / 200 s."""
    relay = RelayServer("127.0.0.1", 0, rate_bytes_s=200_000)
    await relay.start()
    try:
        async with Host(LOCAL) as server, Host(LOCAL) as client:
            serve_test_protocols(server)
            local = ("127.0.0.1", port_of(server))
            held = RelayClient(server.identity, ("127.0.0.1", relay.port), local)
            await client.connect(await held.reserve())
            start = time.monotonic()
            await client.request(
                server.peer_id, ECHO_CONTROL, Echo(data=b"x" * 300_000), timeout=30
            )
            took = time.monotonic() - start
            assert took >= 1.9, took
            await held.close()
    finally:
        await relay.close()
