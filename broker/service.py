"""The broker service: p2p host, registry, serving, job runner, HTTP API, SQLite.

    async with Broker(BrokerConfig(data_dir=DIR)) as broker:
        print(broker.addrs, broker.http_url)
        await stop.wait()

Starting restores what the database holds: models (from the model store), their placements
(their providers have a grace period to re-join and re-announce what they have loaded), and
jobs (placed or running ones go back to the queue; finished microbatches are kept). Closing
cancels the background tasks, stops HTTP and the host, and closes the database.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import ssl
import time
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from broker.auth import ArtifactTokens, HttpArtifacts, Keys, fingerprint
from broker.calls import StageCalls
from broker.challenge import HardwareChecks
from broker.commitcheck import CommitmentChecks
from broker.config import BrokerConfig
from broker.core import Core
from broker.core.actions import Notice
from broker.driver import CoreDriver
from broker.embedjobs import EmbedJobs
from broker.errors import Conflict
from broker.events import EventLog
from broker.finetune.kind import FinetuneJobs
from broker.gateway import Gateway
from broker.gateways import Gateways
from broker.history import watch
from broker.http import ApiParts, make_app
from broker.httpkit import site_url
from broker.jobs import JobRunner
from broker.keys_api import KeyRoutes
from broker.keystore import KeyStore
from broker.leases import Leases
from broker.local_gateway import BrokerBackend
from broker.local_gateway import Parts as GatewayParts
from broker.metrics import Metrics, Readings
from broker.models import ModelStore, StoredModel
from broker.pretrain import TrainJobs
from broker.reach import Reachability
from broker.registry import Registry
from broker.serving import Serving
from broker.store import Store
from broker.verify import Verifier
from files.private import private_dir
from p2p import Host, HostConfig
from p2p.relay import RelayServer
from proto.assign import STAGE_STATUS
from proto.forward import CHAIN
from proto.heartbeat import HEARTBEAT
from proto.join import JOIN
from proto.ping import PING, Ping, Pong

log = logging.getLogger("fusionai.broker")


class Broker:
    """`host` (default: a libp2p host on `config.listen`; an in-memory one in tests), `clock`
    (monotonic seconds: deadlines, heartbeats, the decision core's time; a test's own clock
    to move time on) and `rng` (which tasks are checked, by whom) are injected."""

    def __init__(
        self,
        config: BrokerConfig,
        *,
        host: Host | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        # Jobs' texts, the link secret, the identity, the models: owner-only.
        private_dir(config.data_dir, ("artifacts", "models", "incoming", "adapters", "tls"))
        self.rng = rng or random.SystemRandom()  # spot checks must not be predictable
        self.store = Store(config.db_path, event_log_size=config.event_log_size)
        self.events = EventLog(self.store)
        self.models = ModelStore(config.data_dir, config.max_artifact_bytes)
        self.host = host or Host(HostConfig(listen=config.listen, data_dir=config.data_dir))
        self.driver = CoreDriver(Core(config.core), config.trace, note=f"broker {config.data_dir}")
        self.driver.carry(
            Notice, lambda n: self.events.emit(n.kind, peer=n.peer, job=n.job, **n.data)
        )
        self.keys = KeyStore(self.store.db, Keys(config.api_keys, config.admin_keys))
        self.tokens = ArtifactTokens(config.data_dir, config.artifact_token_s)
        self.metrics = Metrics()
        self.events.sinks.append(self.metrics.event)
        self.tls_sha256 = ""  # the certificate's fingerprint when serving HTTPS
        self.links = HttpArtifacts()  # settled once the HTTP server listens
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stop = asyncio.Event()  # set when closing: loops and open streams end
        self.http_url = ""
        # Set in start(): they need the host's peer id and the HTTP address.
        self.registry: Registry
        self.serving: Serving
        self.calls: StageCalls
        self.jobs: JobRunner
        self.verifier: Verifier
        self.embeds: EmbedJobs
        self.finetunes: FinetuneJobs

    @property
    def peer_id(self) -> str:
        return self.host.peer_id

    @property
    def addrs(self) -> list[str]:
        return list(self.host.addrs)

    async def start(self) -> None:
        await self.host.start()
        self.relay = await self._start_relay()
        self.reachability = Reachability(
            self.host.observed, self.events, relayed=self._relayed_addr, relay_ip=self._relay_ip
        )
        self.registry = Registry(
            self.config,
            self.host.peer_id,
            self.events,
            self.driver,
            clock=self.clock,
            reachability=self.reachability,
            relay_port=lambda: self.relay.port if self.relay is not None else 0,
            checks=None
            if self.config.trust_claims
            else HardwareChecks(self.config, self.host.request, self.rng),
            identity=self.host.identity,
        )
        # Assignments name artifact URLs on the HTTP server (`self.links`, once it listens).
        self.serving = Serving(
            self.config,
            self.registry,
            self.store,
            self.events,
            self.host,
            self.links,
            clock=self.clock,
        )
        self.calls = StageCalls(
            self.config, self.events, self.serving, self.models, self.host, self.metrics.stage
        )
        self.jobs = JobRunner(
            self.store,
            self.events,
            self.driver,
            self.clock,
            self.serving.route,
            lambda model: model in self.models.models,
        )
        self.verifier = Verifier(
            self.config,
            self.store,
            self.events,
            self.registry,
            self.models,
            self.calls.check,
            self.rng,
            self.clock,
            on_quarantine=self.jobs.redo,
        )
        self.embeds = EmbedJobs(
            self.config,
            self.store,
            self.events,
            self.driver,
            self.serving,
            self.models,
            self.calls,
            self.verifier,
            self.jobs.using,
        )
        self.jobs.register(self.embeds)
        parts = (self.config, self.store, self.events, self.serving, self.models, self.calls)
        self.finetunes = FinetuneJobs(*parts)
        self.jobs.register(self.finetunes)
        self.jobs.register(TrainJobs(*parts, self.add_model))
        self.metrics.watch(
            Readings(
                pools=lambda: [p.status.value for p in self.driver.core.pool.providers.values()],
                jobs=self.store.count_jobs,
                queued=self.store.count_queued,
                served=lambda: {
                    name: sum(1 for peers in self.serving.route(name) or [] if peers)
                    for name in self.serving.plans
                },
            )
        )
        self.history = watch(self.config, self.serving, self.store, self.registry, self.events)
        context = self._tls()
        leases = Leases(self._batch_slots, self.jobs.using)
        self.checks = CommitmentChecks(self.models, self.verifier, self.events)
        gateways = Gateways(leases, on_report=self.history.gateway)
        self.metrics.registry.register(gateways)
        self.gateway = gateway = Gateway(  # (the OpenAI endpoints)
            BrokerBackend(GatewayParts(
                self.config,
                self.serving,
                self.registry,
                self.models,
                self.verifier,
                self.embeds,
                self.metrics,
                self.events,
                self.host,
                self.calls.inflight,
                self.keys,
                leases,
                lambda: self.stopping,
                self.rng,
                self.checks,
            )),
            self.config.client_batching,
        )  # fmt: skip
        api = ApiParts(
            self.config,
            self.store,
            self.events,
            self.registry,
            self.serving,
            self.models,
            self.jobs,
            self.finetunes,
            self.verifier,
            self.checks,
            gateway,
            self.keys,
            KeyRoutes(self.keys, leases, gateways),
            self.tokens,
            self.metrics,
            self.history,
            self.calls.inflight,
            self.add_model,
            lambda: self.stopping,
            self.rng,
            self.peer_id,
            self.addrs,
        )
        # (aiohttp's keep-alive timer also runs until a connection's first request head)
        self._runner = web.AppRunner(
            make_app(api), access_log=None, keepalive_timeout=self.config.http_idle_s
        )
        await self._runner.setup()
        site = web.TCPSite(
            self._runner, self.config.http_host, self.config.http_port, ssl_context=context
        )
        await site.start()
        self.http_url = site_url(site, self.config.http_host, context is not None)
        self.links.serve(
            (self.config.public_url or self.http_url).rstrip("/"),
            # providers download from this server: pin its certificate
            self.tls_sha256 if self.config.public_url is None else "",
            # providers have no API key: their URLs carry a token
            self.tokens.token,  # (unused while the API is open: keys can be added later)
        )
        self.host.add_control_handler(JOIN, self.registry.on_join)
        self.host.add_control_handler(HEARTBEAT, self.registry.on_heartbeat)
        self.host.add_control_handler(STAGE_STATUS, self.serving.on_status)
        self.host.add_control_handler(PING, self._on_ping)
        self.host.add_control_handler(CHAIN, self.calls.on_chain_result)
        self._restore()
        self._tasks = [
            asyncio.create_task(self.registry.tick(self._stop)),
            asyncio.create_task(self.jobs.schedule(self._stop)),
            asyncio.create_task(self.history.run(self._stop, self.events.wake)),
        ]
        self.events.emit("broker_started", peer=self.peer_id, addrs=self.addrs, http=self.http_url)

    def _batch_slots(self, model: str) -> int:
        """Sessions `model` takes: its serving providers' batch slots (0: none said)."""
        peers = {p for stage in self.serving.route(model) or [] for p in stage}
        slots = sum(p.max_batch for peer in peers if (p := self.registry.profiles.get(peer)))
        return math.ceil(slots * self.config.sessions_per_slot)

    def _tls(self) -> ssl.SSLContext | None:
        cert, key = self.config.tls_cert, self.config.tls_key
        if cert is None and key is None:
            return None
        if cert is None or key is None:
            raise ValueError("TLS needs both a certificate and its key")
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(
                f"cannot load the TLS certificate {cert} and key {key}: {exc}"
            ) from None
        self.tls_sha256 = fingerprint(cert)
        return context

    def _restore(self) -> None:
        placements = self.store.placements()
        for name, manifest in sorted(self.store.models().items()):
            stored = self.models.load(name, manifest)
            if stored is None:
                self.events.emit("model_missing", model=name)
                continue
            self.serving.add_model(stored, restored=placements.get(name))
        self.jobs.resume()

    async def _on_ping(self, peer: str, msg: Ping) -> Pong:
        return Pong(nonce=msg.nonce, payload=msg.payload)

    async def add_model(self, manifest: bytes) -> StoredModel:
        """Register (or replace) a model; the same manifest again changes nothing. A new
        version is refused while a job runs on the model."""
        known = self.models.models.get(_name_of(manifest))
        if known is not None and known.manifest_bytes == manifest:
            return known
        if known is not None and self.jobs.busy(known.name):
            raise Conflict(f"a job is running on {known.name}; add the new version after it")
        # Hashing and validating multi-GB stages happens off the event loop.
        stored = await asyncio.to_thread(self.models.register, manifest)
        self.store.put_model(stored.name, manifest)
        self.events.emit(
            "model_added",
            model=stored.name,
            stages=len(stored.manifest.stages),
            provider_stages=len(stored.units),
        )
        self.serving.add_model(stored)
        return stored

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    async def close(self) -> None:
        serving: Serving | None = getattr(self, "serving", None)
        # From here the core decides nothing: jobs cancelled and providers unreachable on the
        # way out change no placement; a restart restores what was persisted before.
        self.driver.stop()
        if not self._stop.is_set():
            self._stop.set()
            if self._runner is not None:  # started: open event streams wake up and end
                self.events.emit("broker_stopping")
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if serving is not None:
            await serving.close()
        reachability: Reachability | None = getattr(self, "reachability", None)
        if reachability is not None:
            await reachability.close()
        relay: RelayServer | None = getattr(self, "relay", None)
        if relay is not None:
            await relay.close()
        if self._runner is not None:
            await self._runner.cleanup()
        await self.host.close()
        self.driver.close()
        self.store.close()

    async def _start_relay(self) -> RelayServer | None:
        """The relay for providers behind NAT, on the IP of the first --listen address; it
        serves only providers that joined this broker."""
        if self.config.relay_port is None:
            return None
        ips = [a.split("/")[2] for a in self.config.listen if a.startswith("/ip4/")]
        relay = RelayServer(
            ips[0] if ips else "0.0.0.0",
            self.config.relay_port,
            rate_bytes_s=self.config.relay_rate_bytes_s,
            allowed=lambda peer, ticket: self.registry.alive(peer),
        )
        await relay.start()
        return relay

    def _relay_ip(self, ip: str) -> bool:
        relays = self.registry.relays
        return relays is not None and relays.is_relay(ip)

    def _relayed_addr(self, peer: str) -> str | None:
        """`peer`'s address at our relay as it announces it (the IP it dialled us on)."""
        port = self.relay.relayed_port(peer) if self.relay is not None else None
        profile = self.registry.profiles.get(peer)
        if not port or profile is None:
            return None
        return next((a for a in profile.relayed if f"/tcp/{port}/" in a), None)

    async def __aenter__(self) -> Broker:
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _name_of(manifest: bytes) -> str:
    """The model name a manifest claims ("" if it is not readable; `register` says why)."""
    try:
        name = json.loads(manifest).get("name", "")
    except (ValueError, AttributeError, RecursionError):
        return ""
    return name if isinstance(name, str) else ""


def status_line(broker: Broker) -> str:
    providers = broker.registry.summary(broker.verifier.summary)
    pools: dict[str, int] = {}
    for p in providers:
        pools[p.pool] = pools.get(p.pool, 0) + 1
    jobs = broker.store.jobs(("queued", "placed", "running"))
    parts = [f"{n} {pool}" for pool, n in sorted(pools.items())] or ["no providers"]
    return f"providers: {', '.join(parts)} | jobs running or queued: {len(jobs)}"


def default_data_dir() -> Path:
    from p2p import default_data_dir as base

    return base() / "broker"
