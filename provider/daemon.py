"""The provider daemon: profile, join a broker, host and serve stages, leave safely.

    provider = Provider(ProviderConfig(broker=ADDR, data_dir=DIR))
    await provider.run(stop, now)   # until `stop` (graceful drain) or `now` (leave at once)

The daemon composes the rooms: `membership.py` (join, heartbeats, joining again with backoff),
`assignments.py` (stages assigned by the broker, loaded in the background), `serving.py`
(forward passes, generation sessions, chains), `training.py` (fine-tune steps and snapshot
shards), `files.cache` (the artifact cache). Stopping drains: new requests are refused as
busy, requests in flight finish (up to `drain_s`), the broker is told we leave, and only then
does the host close.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from files.cache import ArtifactCache, human_bytes
from files.private import private_dir
from p2p import Host, HostConfig, P2PError
from p2p.relay import RelayServer
from proto.assign import ASSIGN
from proto.challenge import CHALLENGE
from proto.forward import FORWARD
from proto.join import JOIN, Leave
from proto.ping import PING, Ping, Pong
from proto.session import COMMITMENT_DOMAIN, SESSION, SESSION_CHAIN
from proto.snapshot import SHARD, SNAPSHOT
from proto.train import TRAIN
from provider.addresses import broker_peer_id, dialable
from provider.assignments import Assignments
from provider.challenge import Checks
from provider.config import ProviderConfig
from provider.events import add_event_sink, event, onnxruntime_distributions, two_runtimes
from provider.membership import Membership
from provider.paths import offer_relay, punch_paths
from provider.portmap import PortMapper, wants_mapping
from provider.pretraining import Pretraining
from provider.profile import MachineProfile, free_memory_now, load_or_measure
from provider.serving import Server
from provider.stage import LoadedStage
from provider.status import Ledger, StageRole, Status, Totals
from provider.status import read as read_status
from provider.status import write as write_status
from provider.stepaside import Policy
from provider.training import Training, torch_threads
from provider.watch import watch_machine

__all__ = ["Provider", "ProviderConfig", "add_event_sink"]
DEPARTED_SWEEP_S = 1.0  # how often sessions of disconnected clients are looked for, seconds


class Provider:
    """`host`: serve on this (started) host instead of a libp2p host of its own: tests run
    providers in one process on an in-memory network (`p2p.testing.MemoryNetwork`), calling
    `attach`, `join` and `heartbeat` themselves instead of `run`."""

    def __init__(self, config: ProviderConfig, host: Host | None = None) -> None:
        self.config = config
        self._given_host = host
        self.server = Server(
            max_queue=config.max_queue,
            per_peer=config.per_peer,
            kv_budget_bytes=config.kv_budget_bytes or 1,
            idle_timeout_s=config.idle_timeout_s,
            fault=config.fault,
            compute_slots=config.compute_slots,
            max_batch=config.max_batch,
            batch_window_s=config.batch_window_ms / 1e3,
        )
        private_dir(config.data_dir, ["artifacts"])  # its identity key and artifacts: owner-only
        self.cache = ArtifactCache(config.data_dir / "artifacts", config.cache_bytes)
        self.host: Host | None = None
        self.broker_id = broker_peer_id(config.broker)
        boot = secrets.token_hex(8)  # this process: joining again is not a restart
        self.membership = Membership(config, self.server, self.broker_id, boot)
        self.membership.checks = Checks(config.executor, self.broker_id)
        self.ports = PortMapper(f"fusionai provider {self.config.data_dir.name}")
        self.assignments = Assignments(config, self.server, self.cache, self.broker_id)
        self.training = Training(self.server, self.broker_id, self._training_module)
        self.pretraining = Pretraining(self.broker_id, self._fetch, lambda: self.memory_budget)
        self._modules: dict[str, Any] = {}  # stage key -> torch module for training
        self.policy = Policy(config.step_aside)  # when the machine's owner needs it
        self.aside = asyncio.Event()  # the owner needs the machine: drain, leave, pause
        self.back = asyncio.Event()  # the machine is free again: join again
        self.state = "starting"  # starting, serving, draining, paused, stopped
        self.ledger = Ledger()
        self.started_at = time.time()
        before = read_status(config.data_dir)  # the work of earlier runs carries over
        self.earlier = before.total if before is not None else Totals()

    @property
    def profile(self) -> MachineProfile | None:
        return self.membership.profile

    @profile.setter
    def profile(self, profile: MachineProfile | None) -> None:
        self.membership.profile = profile

    @property
    def memory_budget(self) -> int:
        """Bytes this provider gives to stages and KV caches."""
        return self.assignments.memory_budget

    @memory_budget.setter
    def memory_budget(self, budget: int) -> None:
        self.assignments.memory_budget = self.membership.memory_budget = budget

    @property
    def joined(self) -> asyncio.Event:
        return self.membership.joined

    # ---- start -----------------------------------------------------------------------------

    async def prepare(self) -> MachineProfile:
        """Profile (cached) and verify the artifact cache; both before joining."""
        c = self.config
        profile, fresh = await asyncio.to_thread(
            load_or_measure, c.data_dir, c.executor.kind, c.executor.device, reprofile=c.reprofile
        )
        self.profile = profile
        event("profile", fresh=fresh, seconds=round(profile.seconds, 2))
        best = profile.best(c.executor.kind)
        budget = free_memory_now(best) if c.max_memory_bytes is None else c.max_memory_bytes
        self.memory_budget = int(budget)
        if c.kv_budget_bytes is None:
            self.server.kv_budget = max(1, self.memory_budget // 4)
        runtimes = onnxruntime_distributions()
        if len(runtimes) > 1:
            raise ValueError(two_runtimes(runtimes))
        dropped = await asyncio.to_thread(self.cache.check)
        if dropped:
            event("cache_dropped", artifacts=dropped)
        return profile

    async def run(self, stop: asyncio.Event, now: asyncio.Event | None = None) -> None:
        """Serve until `stop` is set (graceful) or `now` is set (leave at once). When the
        machine's owner needs it (`config.step_aside`), drain, leave and pause; join again
        once it is free."""
        now = now or asyncio.Event()
        if self.profile is None:
            await self.prepare()
        # Threads beyond the compute slots decode the next requests while a stage runs, and
        # leave one free for a session step to wait in line ahead of queued batch work; a
        # batch of session steps holds one thread per step while its run gathers and runs.
        c = self.config
        config = HostConfig(
            listen=c.listen,
            data_dir=c.data_dir,
            compute_threads=c.compute_slots + 7 + (c.max_batch if c.max_batch > 1 else 0),
        )
        given = self._given_host
        offered: RelayServer | None = None
        ended = asyncio.Event()  # the last drain is over: the background tasks end
        try:
            async with contextlib.nullcontext(given) if given is not None else Host(config) as h:
                self.attach(h)
                event("listening", peer_id=h.peer_id, addrs=h.addrs)
                await self._map_port(h)
                offered = await offer_relay(self.config, self.broker_id, h.peer_id)
                if offered is not None:
                    self.membership.relay_offer = (offered.port, self.config.relay_rate_bytes_s)
                background: list[asyncio.Task[Any]] = [
                    asyncio.create_task(self._drop_departed(h, ended)),
                    asyncio.create_task(self._status_line(stop)),
                    asyncio.create_task(self.ports.renew(ended)),
                    asyncio.create_task(self._status_file(ended)),
                    asyncio.create_task(
                        watch_machine(
                            self.config.step_aside, self.policy, self.aside, self.back, ended
                        )
                    ),
                ]
                while not (stop.is_set() or now.is_set()):
                    if self.aside.is_set():  # (also at start: the owner's hours, a game)
                        await self._pause(stop, now)
                    else:
                        await self._serve(stop, now)
                ended.set()
                for t in background:
                    t.cancel()
                await asyncio.gather(*background, return_exceptions=True)
                self.server.stop()
        finally:
            if offered is not None:
                await offered.close()
            self.state = "stopped"
            self._write_status()
            await self.ports.close()
            await self.membership.close_relay()
            await self.detach()

    async def _serve(self, stop: asyncio.Event, now: asyncio.Event) -> None:
        """Be a member of the pool until `stop`, `now` or the owner's need (`aside`), then
        drain and leave (not for `now`)."""
        self.state = "serving"
        left = asyncio.Event()  # membership runs until the drain is over
        membership = asyncio.create_task(self.membership.run(left))
        waiters = [asyncio.create_task(e.wait()) for e in (stop, now, self.aside)]
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for t in waiters:
            t.cancel()
        if not now.is_set():
            self.state = "draining"
            await self._drain(now)
        left.set()
        pending = [membership, *self.assignments.tasks()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def _pause(self, stop: asyncio.Event, now: asyncio.Event) -> None:
        """Stepped aside: give the memory back, wait until the machine is free, and get
        ready to join again (as the same process: its boot id is kept)."""
        dropped = self.assignments.unload_all()
        self.membership.joined.clear()
        self.membership.pool = ""
        self.state = "paused"
        event("paused", reasons=list(self.policy.reasons), unloaded=dropped)
        self._write_status()
        waiters = [asyncio.create_task(e.wait()) for e in (stop, now, self.back)]
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for t in waiters:
            t.cancel()
        self.server.draining = False
        self.membership.told_draining.clear()
        if not (stop.is_set() or now.is_set()):
            event("resuming")

    async def _drop_departed(self, host: Host, stop: asyncio.Event) -> None:
        """Every `DEPARTED_SWEEP_S`, drop the sessions (and KV caches) of clients no longer
        connected: a client that went away frees its caches within two sweeps."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), DEPARTED_SWEEP_S)
            except TimeoutError:
                pass
            for peer, n in self.server.disconnected(set(host.connected_peers())).items():
                event("sessions_dropped", peer=peer, sessions=n, reason="disconnected")

    async def _map_port(self, host: Host) -> None:
        """Behind a home router: ask it to forward a public port here (UPnP), and announce
        that address first."""
        local = wants_mapping(dialable(host.addrs))
        if not self.config.upnp or self.config.announce or local is None:
            return
        mapping = await self.ports.open(local)
        if mapping is None:
            event("port_mapping", mapped=False, local=f"{local[0]}:{local[1]}")
            return
        self.membership.extra_addrs = [f"{mapping.addr}/p2p/{host.peer_id}"]
        event("port_mapping", mapped=True, address=mapping.addr, local=f"{local[0]}:{local[1]}")

    def attach(self, host: Host) -> None:
        """Serve on `host` (started): stage requests, pings, assignments, training."""
        self.host = self.membership.host = self.assignments.host = self.training.host = host
        if self.assignments.http is None:
            timeout = aiohttp.ClientTimeout(total=None, sock_read=60.0)
            self.assignments.http = aiohttp.ClientSession(timeout=timeout)
        self.server.peer_id, self.server.broker_id = host.peer_id, self.broker_id
        identity = host.identity
        self.server.sign = lambda data: identity.sign(data, domain=COMMITMENT_DOMAIN)
        host.add_compute_handler(FORWARD, self.server.forward)
        host.add_control_handler(PING, self._on_ping)
        host.add_compute_handler(SESSION, self.server.session)
        host.add_compute_handler(SESSION_CHAIN, self.server.chain_step)
        host.add_control_handler(ASSIGN, self.assignments.on_assign)
        if self.membership.checks is not None:  # the broker's hardware check at join
            host.add_compute_handler(CHALLENGE, self.membership.checks.on_challenge)
        host.add_compute_handler(TRAIN, self.training.train)
        host.add_compute_handler(SHARD, self.training.shard)
        host.add_control_handler(SNAPSHOT, self.training.snapshot)
        self.pretraining.attach(host)
        # a peer that reached us through our relay may punch a direct connection, and we
        # punch to the next hop of a chained request that we reached through its relay
        if self.config.punch:
            m = self.membership
            self.puncher, self.server.before_relay = punch_paths(
                host, m.relay_endpoint, m.relay_origin
            )

    async def detach(self) -> None:
        """Stop loading, close the artifact downloads' session, forget the host."""
        tasks = [*self.assignments.tasks(), *self.training.stragglers]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        http, self.assignments.http = self.assignments.http, None
        if http is not None:
            await http.close()
        self.host = self.membership.host = self.assignments.host = None

    async def join(self) -> None:
        """Join the broker once (raises `membership.Refused` with its reason)."""
        await self.membership.join()

    async def heartbeat(self) -> None:
        """One heartbeat (raises `membership.Rejoin` if the broker does not know us)."""
        await self.membership.heartbeat()

    async def _fetch(self, sha: str, url: str, size: int, pin: str) -> Path:
        """An artifact from the broker's links, into the cache (a pre-training replica's)."""
        return await self.cache.fetch(sha, url, size, session=self.assignments.http, pin=pin)

    def _training_module(self, stage: LoadedStage) -> Any:
        """A torch module of the stage's validated ONNX file (the torch executor's own when the
        stage runs on it), built once per stage."""
        module = getattr(stage.executor, "module", None)
        if module is not None:
            return module
        cached = self._modules.get(stage.key)
        if cached is not None and cached[0] == stage.info.sha256:
            return cached[1]
        try:
            from ir.executors.torch_exec import OnnxModule
        except ImportError as exc:
            raise ImportError(
                f"training needs torch (pip install fusionai[torch]): {exc}"
            ) from None
        from ir.validate import validate_onnx_file

        torch_threads()
        path = self.cache.path(stage.info.sha256)
        model = validate_onnx_file(path, sha256=stage.info.sha256, package_dir=path.parent)
        module = OnnxModule(model).eval()
        self._modules[stage.key] = (stage.info.sha256, module)
        return module

    async def _drain(self, now: asyncio.Event) -> None:
        event("draining", in_flight=self.server.in_flight, deadline_s=self.config.drain_s)
        self.server.draining = True  # refuse new work now; the next heartbeat says so
        self.membership.wake.set()  # send that heartbeat at once
        drained = asyncio.create_task(asyncio.to_thread(self.server.drain, self.config.drain_s))
        cut = asyncio.create_task(now.wait())
        await asyncio.wait([drained, cut], return_when=asyncio.FIRST_COMPLETED)
        cut.cancel()
        clean = drained.done() and drained.result()
        event("drained", clean=bool(clean), in_flight=self.server.in_flight)
        if self.joined.is_set() and not now.is_set():
            # The broker hears "draining" (and hands our stages over) before "left", however
            # quick the drain was; bounded, in case it cannot be reached.
            told = asyncio.create_task(self.membership.told_draining.wait())
            cut = asyncio.create_task(now.wait())
            await asyncio.wait(
                [told, cut],
                timeout=max(2.0, 2 * self.membership.heartbeat_s),
                return_when=asyncio.FIRST_COMPLETED,
            )
            told.cancel()
            cut.cancel()
        if self.joined.is_set() and self.host is not None and not now.is_set():
            try:
                await self.host.request(
                    self.broker_id, JOIN, Leave(reason="provider stopped"), timeout=5.0
                )
                event("left", broker=self.broker_id)
            except P2PError as exc:
                event("leave_failed", error=str(exc))

    async def _on_ping(self, peer: str, msg: Ping) -> Pong:
        """The broker checks that we answer before it declares us lost (a request to us
        failed). Only the broker gets the payload echoed; others get the nonce alone, so we
        are no bandwidth reflector."""
        return Pong(nonce=msg.nonce, payload=msg.payload if peer == self.broker_id else b"")

    # ---- status ----------------------------------------------------------------------------

    def status(self) -> Status:
        """What `fusionai provider status` shows (and the work done, counted up to now)."""
        stages = list(self.server.stages.values())
        serving = any(s.role == "active" for s in stages)
        online = self.joined.is_set() and self.state == "serving"
        self.ledger.tick(time.monotonic(), online, serving)
        run = Totals(
            self.server.tokens_served,
            self.server.runs,
            self.ledger.online_s,
            self.ledger.serving_s,
        )
        state = "joining" if self.state == "serving" and not self.joined.is_set() else self.state
        return Status(
            pid=os.getpid(),
            broker=self.config.broker,
            started_at=self.started_at,
            updated_at=time.time(),
            state=state,
            reason="; ".join(self.policy.reasons) if self.state == "paused" else "",
            peer_id=self.host.peer_id if self.host is not None else "",
            pool=self.membership.pool if self.joined.is_set() else "",
            reach=self.membership.reach,
            stages=[StageRole(s.key, s.role) for s in sorted(stages, key=lambda s: s.key)],
            run=run,
            total=self.earlier.plus(run),
        )

    def _write_status(self) -> None:
        try:
            write_status(self.config.data_dir, self.status())
        except OSError as exc:  # a full disk must not stop serving
            logging.getLogger("fusionai.provider").warning("status file: %s", exc)

    async def _status_file(self, ended: asyncio.Event) -> None:
        every = self.config.status_file_every_s
        while not ended.is_set():
            self._write_status()
            try:
                await asyncio.wait_for(ended.wait(), every)
            except TimeoutError:
                pass

    async def _status_line(self, stop: asyncio.Event) -> None:
        every = self.config.status_every_s
        if every <= 0 or sys.stderr is None or not sys.stderr.isatty():
            return
        while not stop.is_set():
            stages = self.server.stages.values()
            active = sum(1 for s in stages if s.role == "active")
            line = (
                f"{'joined' if self.joined.is_set() else 'joining'} | stages {len(stages)} "
                f"({active} serving, {len(self.assignments.loading)} loading) | in flight "
                f"{self.server.in_flight} | sessions {len(self.server.sessions)} | kv "
                f"{human_bytes(self.server.kv_bytes())}"
            )
            sys.stderr.write(f"\r{line:100}")
            sys.stderr.flush()
            try:
                await asyncio.wait_for(stop.wait(), every)
            except TimeoutError:
                pass
        sys.stderr.write("\n")
