"""Relays providers offer: the broker takes an offer only where a relay greets it, on the IP
the provider connects from; it sends a provider that needs a relay to the one with the most
bandwidth per provider, with a ticket that relay checks; the cost model sees a relayed
provider's share of its relay's cap. Real relays on loopback sockets, in-process."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator

import pytest

from broker.relays import Relays
from p2p import Identity
from p2p.relay import RelayClient, RelayError, RelayServer
from proto.join import relay_ticket_ok
from tests.test_broker.inproc import crafted_profile

pytestmark = pytest.mark.timeout(30)
MBIT = 1e6 / 8


@pytest.fixture
async def relay() -> AsyncIterator[RelayServer]:
    server = RelayServer("127.0.0.1", 0)
    await server.start()
    yield server
    await server.close()


def relays(own_rate: float | None, profiles: list, alive: set[str] | None = None) -> Relays:
    """(own_rate None: the broker runs no relay of its own)"""
    broker = Identity.ephemeral()
    is_alive = lambda p: alive is None or p in alive  # noqa: E731
    return Relays(broker, own_rate or 0.0, own_rate is not None, is_alive, lambda: profiles)


async def test_an_offer_is_taken_only_where_a_relay_greets_on_the_providers_ip(
    relay: RelayServer,
) -> None:
    r = relays(MBIT, [])
    offer = crafted_profile(relay_port=relay.port, relay_rate=40 * MBIT)
    assert await r.offer("p", "/ip4/127.0.0.1/tcp/40000", offer) == ""
    assert r.offers["p"].addr == f"/ip4/127.0.0.1/tcp/{relay.port}" and r.is_relay("127.0.0.1")

    async def not_a_relay(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\n\r\n")
        writer.close()

    other = await asyncio.start_server(not_a_relay, "127.0.0.1", 0)
    port = other.sockets[0].getsockname()[1]
    async with other:
        why = await r.offer(
            "q", "/ip4/127.0.0.1/tcp/1", crafted_profile(relay_port=port, relay_rate=MBIT)
        )
    assert "did not greet as a relay" in why and "q" not in r.offers
    closed = await r.offer(
        "q", "/ip4/127.0.0.1/tcp/1", crafted_profile(relay_port=port, relay_rate=MBIT)
    )
    assert "did not answer" in closed
    assert "does not know the IP" in await r.offer("q", None, offer)
    assert await r.offer("p", "/ip4/127.0.0.1/tcp/1", crafted_profile()) == ""  # withdrawn
    assert "p" not in r.offers


async def test_a_provider_is_sent_to_the_relay_with_the_most_bandwidth_per_provider(
    relay: RelayServer,
) -> None:
    at_offer = f"/ip4/127.0.0.1/tcp/{relay.port + 1}/p2p/x"
    carried = [crafted_profile(relayed=[at_offer]) for _ in range(3)]
    r = relays(10 * MBIT, carried, alive={"relay", "p"})
    offer = crafted_profile(relay_port=relay.port, relay_rate=40 * MBIT)
    assert await r.offer("relay", "/ip4/127.0.0.1/tcp/1", offer) == ""
    addr, ticket = r.choose("p")  # 40 / (3 + 1) = 10 is not more than the broker's 10 / 1
    assert (addr, ticket) == ("", "")
    del carried[0]  # 40 / 3 beats 10
    addr, ticket = r.choose("p")
    assert addr == f"/ip4/127.0.0.1/tcp/{relay.port}" and ticket
    broker = r.identity.peer_id
    assert relay_ticket_ok(broker, "relay", "p", ticket, time.time())
    assert not relay_ticket_ok(broker, "relay", "someone-else", ticket, time.time())
    assert not relay_ticket_ok(broker, "another-relay", "p", ticket, time.time())
    assert not relay_ticket_ok(broker, "relay", "p", ticket, time.time() + 3600)  # expired
    assert not relay_ticket_ok(broker, "relay", "p", "1." + ticket.split(".")[1], 0)  # altered
    assert not relay_ticket_ok(broker, "relay", "p", "nonsense", 0)
    assert r.choose("relay") == ("", "")  # not to its own relay
    assert r.share(carried[0]) == pytest.approx(40 * MBIT / 2)
    assert r.share(crafted_profile(relayed=["/ip4/10.9.9.9/tcp/5/p2p/y"])) == 10 * MBIT
    r.alive = lambda p: p != "relay"  # its provider is gone: no longer offered
    assert r.choose("p") == ("", "") and not r.is_relay("127.0.0.1")
    assert relays(0.0, []).share(carried[0]) == math.inf  # an uncapped broker relay
    assert relays(None, []).choose("p") == ("", "")  # no relay of its own, no offers


async def test_a_providers_relay_reserves_only_with_its_brokers_ticket() -> None:
    broker, me, peer = Identity.ephemeral(), Identity.ephemeral(), Identity.ephemeral()
    server = RelayServer(
        "127.0.0.1", 0,
        allowed=lambda p, t: relay_ticket_ok(broker.peer_id, me.peer_id, p, t, time.time()),
    )  # fmt: skip
    await server.start()
    r = Relays(broker, 1.0, True, lambda p: True, lambda: [])
    offer = crafted_profile(relay_port=server.port, relay_rate=40 * MBIT)
    assert await r.offer(me.peer_id, "/ip4/127.0.0.1/tcp/1", offer) == ""
    _, ticket = r.choose(peer.peer_id)
    try:
        for bad in ("", ticket.replace(".", ".00", 1)):
            stranger = RelayClient(peer, ("127.0.0.1", server.port), ("127.0.0.1", 9), bad)
            with pytest.raises(RelayError, match="serves only the providers of its broker"):
                await stranger.reserve()
        held = RelayClient(peer, ("127.0.0.1", server.port), ("127.0.0.1", 9), ticket)
        assert (await held.reserve()).startswith("/ip4/127.0.0.1/tcp/")
        assert peer.peer_id in server.reservations
        await held.close()
    finally:
        await server.close()
