"""A broker and real provider daemons in this process, on an in-memory network and a clock the
test moves: the broker's registry, serving and job runner tested in milliseconds.

Everything is the product's own code (`broker.Broker`, `provider.daemon.Provider` and its
stage hosting and serving, real SQLite, real ONNX stages downloaded over the broker's real
HTTP server on 127.0.0.1) but the transport (`p2p.testing.MemoryNetwork`) and the timers: the
test joins providers, sends their heartbeats and moves the broker's clock itself.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import msgspec

from broker.config import BrokerConfig
from broker.core.events import ClockTicked
from broker.service import Broker
from p2p import Host, Identity
from p2p.testing import MemoryHost, MemoryNetwork
from proto.join import JOIN_DOMAIN, ExecutorInfo, Join, JoinProfile, signed_join_bytes
from provider.config import ProviderConfig
from provider.daemon import Provider
from provider.profile import ExecutorProfile, MachineProfile

# What a provider measured (a 2-core CPU machine); the same for every provider unless said.
PROFILE = MachineProfile(
    key="inproc",
    cpu="in-process test CPU",
    cpu_cores=2,
    gpu=None,
    gpu_driver=None,
    executors=[
        ExecutorProfile("ort", "CPUExecutionProvider", {"float32": 5e10}, 1e10, 8 << 30, 8 << 30)
    ],
    measured_at=0.0,
    seconds=0.0,
)


class Clock:
    """The broker's monotonic clock, moved by the test."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> float:
        self.t += seconds
        return self.t


@dataclass
class Swarm:
    net: MemoryNetwork
    clock: Clock
    root: Path
    broker: Broker
    settings: dict[str, Any]
    providers: dict[str, Provider] = field(default_factory=dict)  # peer id -> provider

    async def restart(self) -> None:
        """Stop the broker and start it again on the same data folder (its identity, its
        database), on the same network; providers must join again."""
        await self.broker.close()
        self.broker.host.identity.close()
        self.broker = await _broker(self.net, self.clock, self.root, self.settings)

    async def provider(self, profile: MachineProfile = PROFILE, **config: Any) -> Provider:
        """A provider daemon on the network, joined, claiming `profile`."""
        host = self.net.host()
        await host.start()
        folder = self.root / f"provider-{len(self.providers)}"
        settings: dict[str, Any] = {"max_memory_bytes": 2 << 30, "drain_s": 1.0}
        provider = Provider(
            ProviderConfig(broker=self.broker.addrs[0], data_dir=folder, **{**settings, **config}),
            host=cast(Host, host),
        )
        provider.profile = profile
        provider.memory_budget = provider.config.max_memory_bytes or 0
        provider.server.kv_budget = provider.memory_budget // 4
        provider.attach(cast(Host, host))
        try:
            await provider.join()
        except BaseException:
            await provider.detach()
            await host.close()
            raise
        self.providers[host.peer_id] = provider
        return provider

    async def heartbeats(self, *skip: Provider) -> None:
        """Every live provider but `skip` sends a heartbeat."""
        for peer, p in self.providers.items():
            if p not in skip and peer in self.net.hosts:
                await p.heartbeat()

    def tick(self, seconds: float = 0.0) -> None:
        """Time passes on the broker's clock, and its membership tick runs."""
        self.broker.registry.driver.handle(ClockTicked(self.clock.advance(seconds)))

    async def elapse(self, seconds: float, *silent: Provider) -> None:
        """`seconds` pass on the broker's clock, in steps of half a heartbeat interval: live
        providers but `silent` send their heartbeats, and the membership tick runs."""
        step = self.broker.config.heartbeat_s / 2
        left = seconds
        while left > 0:
            self.clock.advance(min(step, left))
            left -= step
            await self.heartbeats(*silent)
            self.tick()

    def kill(self, provider: Provider) -> str:
        assert provider.host is not None
        peer = provider.host.peer_id
        self.net.kill(peer)
        return peer

    async def add_model(self, package: Path) -> str:
        """Upload a package's artifacts into the broker's store and add the model."""
        manifest = (package / "manifest.json").read_bytes()
        doc = json.loads(manifest)
        files = {s["file"]: s["sha256"] for s in doc["stages"]}
        if doc.get("tokenizer"):
            files[doc["tokenizer"]] = doc["tokenizer_sha256"]
        for name, sha in files.items():

            async def chunks(path: Path = package / name) -> AsyncIterator[bytes]:
                yield await asyncio.to_thread(path.read_bytes)

            await self.broker.models.receive(sha, chunks())
        stored = await self.broker.add_model(manifest)
        return stored.name

    async def until(
        self,
        what: str,
        check: Callable[[], Any],
        timeout: float = 30.0,
        explain: Callable[[], Any] | None = None,
    ) -> Any:
        """The first truthy `check()`, letting the broker and providers work meanwhile; on a
        timeout the error carries `explain()` (the state that would tell why)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while loop.time() < end:
            value = check()
            if value:
                return value
            await asyncio.sleep(0.005)
        why = f": {explain()}" if explain is not None else ""
        raise AssertionError(f"timed out after {timeout} s waiting for {what}{why}")

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [e.to_json() for e in self.broker.store.events(limit=100_000) if e.kind == kind]

    async def close(self) -> None:
        for p in self.providers.values():
            await p.detach()
        for host in list(self.net.hosts.values()):
            await host.close()
        await self.broker.close()
        self.broker.host.identity.close()


async def swarm(root: Path, **config: Any) -> Swarm:
    """A started broker (heartbeats every 5 s on its own clock; the test sends them). It
    believes the providers' profiles (tests of placement give them made-up ones) unless
    `trust_claims=False`: then each join is checked on the provider's real executor."""
    settings = {
        "http_port": 0,
        "verify_fraction": 0.0,
        "relay": "chain",
        "relay_port": None,  # (an in-memory network: no relay of TCP bytes)
        "trust_claims": True,
        **config,
    }
    net, clock = MemoryNetwork(), Clock()
    return Swarm(net, clock, root, await _broker(net, clock, root, settings), settings)


async def _broker(net: MemoryNetwork, clock: Clock, root: Path, settings: dict[str, Any]) -> Broker:
    identity = Identity.load_or_create(root / "broker")  # as a broker's host does
    broker = Broker(
        BrokerConfig(data_dir=root / "broker", **settings),
        host=cast(Host, net.host(identity)),
        clock=clock,
        rng=random.Random(7),
    )
    await broker.start()
    return broker


def host_of(provider: Provider) -> MemoryHost:
    return cast(MemoryHost, provider.host)


def crafted_profile(**fields: Any) -> JoinProfile:
    """A join profile as a hand-written peer would send it (a 2-core CPU), but for `fields`."""
    settings: dict[str, Any] = {
        "gpu": None,
        "cpu": "cpu",
        "cpu_cores": 2,
        "executors": [ExecutorInfo("ort", "cpu", {"float32": 5e10}, 1e10, 8 << 30, 8 << 30)],
        "executor": "ort",
        "memory_limit_bytes": 2 << 30,
        "net_up_bytes_s": 1e8,
        "rtt_s": 0.05,
        "version": "test",
    }
    return JoinProfile(**{**settings, **fields})


def signed_join(
    identity: Identity, broker: str, profile: JoinProfile | bytes, **fields: Any
) -> Join:
    """A join signed with `identity`'s key (now, unless `timestamp` is given)."""
    body = profile if isinstance(profile, bytes) else msgspec.json.encode(profile)
    stamp = fields.pop("timestamp", time.time())
    signature = identity.sign(signed_join_bytes(body, broker, stamp), domain=JOIN_DOMAIN)
    return Join(profile=body, signature=signature, broker=broker, timestamp=stamp, **fields)
