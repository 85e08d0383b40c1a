"""Our hosts speak Noise and yamux only: plaintext and secio dials are refused."""

from __future__ import annotations

import asyncio

import pytest

from p2p import Host
from p2p.testing import ECHO_CONTROL, LOCAL, Echo, dial_with_security, serve_test_protocols

pytestmark = pytest.mark.timeout(90)


async def test_plaintext_and_secio_dials_are_refused_noise_is_accepted() -> None:
    async with Host(LOCAL) as host:
        serve_test_protocols(host)
        addr = host.addrs[0]
        plaintext = await asyncio.to_thread(dial_with_security, addr, "plaintext")
        secio = await asyncio.to_thread(dial_with_security, addr, "secio")
        noise = await asyncio.to_thread(dial_with_security, addr, "noise")
        assert "failed to negotiate the secure protocol" in plaintext, plaintext
        assert "failed to negotiate the secure protocol" in secio, secio
        assert noise == "connected"  # the probe itself works: the refusals are real
        # The host keeps serving after the refused dials.
        async with Host(LOCAL) as client:
            peer = await client.connect(addr)
            assert (await client.request(peer, ECHO_CONTROL, Echo(n=1))).n == 2
