"""The provider daemon: profile, join a broker, host and serve stages, leave safely.

    provider = Provider(ProviderConfig(broker=ADDR, data_dir=DIR))
    await provider.run(stop, now)   # until `stop` (graceful drain) or `now` (leave at once)

Joining sends the measured hardware profile, signed with the provider's identity, plus the
measured round trip and bandwidth to the broker. Heartbeats follow; when the broker cannot be
reached, or answers that it does not know us (it restarted), the provider joins again with
exponential backoff and re-announces the stages it still has loaded. Assignments are
acknowledged at once and loaded in the background; the broker hears "ready" or "failed, why".
Stopping drains: new requests are refused as busy, requests in flight finish (up to
`drain_s`), the broker is told we leave, and only then does the host close.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import secrets
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from files.cache import ArtifactCache, human_bytes
from p2p import ConnectionLost, Host, HostConfig, P2PError, RemoteError, RequestTimeout
from proto.assign import (
    ASSIGN,
    STAGE_STATUS,
    Assign,
    AssignAck,
    Promote,
    StageStatus,
    Unassign,
)
from proto.forward import FORWARD
from proto.heartbeat import HEARTBEAT, Heartbeat
from proto.join import JOIN, JOIN_DOMAIN, ExecutorInfo, Join, JoinProfile, Leave, signed_join_bytes
from proto.ping import PING, Ping, Pong
from proto.session import SESSION
from proto.snapshot import SHARD, SNAPSHOT
from proto.train import TRAIN
from provider.hosting import ExecutorChoice, StageRefused, host, memory_needed, stage_of
from provider.profile import MachineProfile, free_memory_now, load_or_measure
from provider.serving import Fault, LoadedStage, Server
from provider.training import Training, torch_threads

log = logging.getLogger("fusionai.provider")

FAST_RETRY_S = 30.0  # seconds of an outage during which joins are retried about every second


@dataclass(frozen=True)
class ProviderConfig:
    broker: str  # the broker's multiaddr, ending in /p2p/<peer id>
    data_dir: Path
    listen: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    announce: tuple[str, ...] = ()  # addresses others dial instead of the listen ones (e.g.
    # a public address forwarded to this machine); /p2p/<peer id> is added when missing
    executor: ExecutorChoice = field(default_factory=ExecutorChoice)
    max_memory_bytes: int | None = None  # None: the device's free memory when profiled
    cache_bytes: int = 20 * 1024**3  # artifact cache size limit
    drain_s: float = 30.0  # how long a graceful stop waits for requests in flight
    join_token: str | None = None
    reprofile: bool = False
    max_queue: int = 32
    per_peer: int = 8
    compute_slots: int = 1  # stage runs at once (each uses every core, or the GPU)
    kv_budget_bytes: int | None = None  # None: a quarter of the memory budget
    idle_timeout_s: float = 300.0
    fault: Fault | None = None
    backoff_max_s: float = 30.0
    status_every_s: float = 5.0  # live status line on a terminal (0: off)


def _version() -> str:
    try:
        return metadata.version("fusionai")
    except metadata.PackageNotFoundError:
        return "0+unknown"


EventSink = Callable[[dict[str, Any]], None]
_sinks: list[EventSink] = []


def add_event_sink(sink: EventSink) -> None:
    """Also hand every event (a dict with "event", "t" and its fields) to `sink`."""
    _sinks.append(sink)


def _event(name: str, **fields: Any) -> None:
    """A structured log line: the event name and its fields as JSON."""
    log.info("%s %s", name, json.dumps(fields, default=str, sort_keys=True))
    for sink in _sinks:
        sink({"event": name, "t": round(time.time(), 3), **fields})


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
        )
        self.cache = ArtifactCache(config.data_dir / "artifacts", config.cache_bytes)
        self.profile: MachineProfile | None = None
        self.memory_budget = 0
        self.host: Host | None = None
        self.broker_id = broker_peer_id(config.broker)
        self.boot = secrets.token_hex(8)  # this process: joining again is not a restart
        self.joined = asyncio.Event()
        self.heartbeat_s = 5.0
        self.loading: dict[str, asyncio.Task[None]] = {}
        self._http: aiohttp.ClientSession | None = None
        self._seq = 0
        self._wake = asyncio.Event()  # send a heartbeat now (draining started)
        self._told_draining = asyncio.Event()  # the broker acknowledged we are draining
        self._status_tasks: set[asyncio.Task[None]] = set()
        self._reserved: dict[str, int] = {}  # memory reserved by stages being loaded
        self._pending: dict[str, Assign] = {}  # the assignment each load is for
        self.training = Training(self.server, self.broker_id, self._training_module)
        self._modules: dict[str, Any] = {}  # stage key -> torch module for training

    # ---- start -----------------------------------------------------------------------------

    async def prepare(self) -> MachineProfile:
        """Profile (cached) and verify the artifact cache; both before joining."""
        c = self.config
        profile, fresh = await asyncio.to_thread(
            load_or_measure, c.data_dir, c.executor.kind, c.executor.device, reprofile=c.reprofile
        )
        self.profile = profile
        _event("profile", fresh=fresh, seconds=round(profile.seconds, 2))
        best = profile.best(c.executor.kind)
        budget = free_memory_now(best) if c.max_memory_bytes is None else c.max_memory_bytes
        self.memory_budget = int(budget)
        if c.kv_budget_bytes is None:
            self.server.kv_budget = max(1, self.memory_budget // 4)
        runtimes = onnxruntime_distributions()
        if len(runtimes) > 1:
            _event(
                "warning",
                message=f"several onnxruntime packages are installed ({', '.join(runtimes)}); "
                "they overwrite each other's files. Keep one: pip uninstall the others, then "
                "reinstall the one you want (fusionai[cuda] or fusionai[directml])",
            )
        dropped = await asyncio.to_thread(self.cache.check)
        if dropped:
            _event("cache_dropped", artifacts=dropped)
        return profile

    def used_memory(self) -> int:
        """Memory of loaded stages, stages being loaded, and the KV-cache budget."""
        stages = sum(memory_needed(s.info) for s in self.server.stages.values())
        return stages + sum(self._reserved.values()) + self.server.kv_budget

    async def run(self, stop: asyncio.Event, now: asyncio.Event | None = None) -> None:
        """Serve until `stop` is set (graceful) or `now` is set (leave at once)."""
        now = now or asyncio.Event()
        if self.profile is None:
            await self.prepare()
        # Threads beyond the compute slots decode the next requests while a stage runs, and
        # leave one free for a session step to wait in line ahead of queued batch work.
        config = HostConfig(
            listen=self.config.listen,
            data_dir=self.config.data_dir,
            compute_threads=self.config.compute_slots + 7,
        )
        given = self._given_host
        try:
            async with contextlib.nullcontext(given) if given is not None else Host(config) as h:
                self.attach(h)
                _event("listening", peer_id=h.peer_id, addrs=h.addrs)
                left = asyncio.Event()  # membership runs until the drain is over
                tasks: list[asyncio.Task[Any]] = [
                    asyncio.create_task(self._membership(left)),
                    asyncio.create_task(self._status_line(stop)),
                ]
                waiters: list[asyncio.Task[Any]] = [
                    asyncio.create_task(stop.wait()),
                    asyncio.create_task(now.wait()),
                ]
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                for t in waiters:
                    t.cancel()
                if not now.is_set():
                    await self._drain(now)
                left.set()
                for t in [*tasks, *self.loading.values(), *self._status_tasks]:
                    t.cancel()
                await asyncio.gather(
                    *tasks, *self.loading.values(), *self._status_tasks, return_exceptions=True
                )
                self.server.stop()
        finally:
            await self.detach()

    def attach(self, host: Host) -> None:
        """Serve on `host` (started): stage requests, pings, assignments, training."""
        self.host = host
        if self._http is None:
            timeout = aiohttp.ClientTimeout(total=None, sock_read=60.0)
            self._http = aiohttp.ClientSession(timeout=timeout)
        self.server.peer_id, self.server.broker_id = host.peer_id, self.broker_id
        host.add_compute_handler(FORWARD, self.server.forward)
        host.add_control_handler(PING, self._on_ping)
        host.add_compute_handler(SESSION, self.server.session)
        host.add_control_handler(ASSIGN, self._on_assign)
        host.add_compute_handler(TRAIN, self.training.train)
        host.add_compute_handler(SHARD, self.training.shard)
        host.add_control_handler(SNAPSHOT, self.training.snapshot)
        self.training.host = host

    async def detach(self) -> None:
        """Stop loading, close the artifact downloads' session, forget the host."""
        tasks = [*self.loading.values(), *self._status_tasks, *self.training.stragglers]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._http is not None:
            await self._http.close()
            self._http = None
        self.host = None

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
        _event("draining", in_flight=self.server.in_flight, deadline_s=self.config.drain_s)
        self.server.draining = True  # refuse new work now; the next heartbeat says so
        self._wake.set()  # send that heartbeat at once
        drained = asyncio.create_task(asyncio.to_thread(self.server.drain, self.config.drain_s))
        cut = asyncio.create_task(now.wait())
        await asyncio.wait([drained, cut], return_when=asyncio.FIRST_COMPLETED)
        cut.cancel()
        clean = drained.done() and drained.result()
        _event("drained", clean=bool(clean), in_flight=self.server.in_flight)
        if self.joined.is_set() and not now.is_set():
            # The broker hears "draining" (and hands our stages over) before "left", however
            # quick the drain was; bounded, in case it cannot be reached.
            told = asyncio.create_task(self._told_draining.wait())
            cut = asyncio.create_task(now.wait())
            await asyncio.wait(
                [told, cut],
                timeout=max(2.0, 2 * self.heartbeat_s),
                return_when=asyncio.FIRST_COMPLETED,
            )
            told.cancel()
            cut.cancel()
        if self.joined.is_set() and self.host is not None and not now.is_set():
            try:
                await self.host.request(
                    self.broker_id, JOIN, Leave(reason="provider stopped"), timeout=5.0
                )
                _event("left", broker=self.broker_id)
            except P2PError as exc:
                _event("leave_failed", error=str(exc))

    # ---- membership ------------------------------------------------------------------------

    async def _membership(self, stop: asyncio.Event) -> None:
        """Join, then heartbeat; on any failure join again with backoff."""
        backoff = 0.5
        immediate = True  # one immediate re-join after the broker forgot us, then backoff
        outage_since: float | None = None
        while not stop.is_set():
            if self.server.draining and not self.joined.is_set():
                return  # leaving: no point in joining again
            try:
                await self._join()
                backoff = 0.5
                outage_since = None
                await self._heartbeats(stop)
            except (P2PError, OSError) as exc:
                self.joined.clear()
                _event("broker_unreachable", error=str(exc), retry_s=round(backoff, 1))
            except _Rejoin as exc:
                self.joined.clear()
                _event("rejoin", reason=str(exc))
                if immediate:
                    immediate = False
                    continue
            except _Refused as exc:
                self.joined.clear()
                _event("join_refused", reason=str(exc))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # an unexpected answer: say so, keep trying
                self.joined.clear()
                log.exception("membership with the broker failed")
                _event("broker_error", error=f"{type(exc).__name__}: {exc}")
            if outage_since is None:
                outage_since = time.monotonic()
            # Retry about once a second for the first FAST_RETRY_S of an outage (a broker
            # restart takes seconds), then back off exponentially; jitter spreads the swarm.
            fast = time.monotonic() - outage_since < FAST_RETRY_S
            delay = min(1.0, backoff) if fast else backoff
            try:
                await asyncio.wait_for(stop.wait(), delay * random.uniform(0.5, 1.0))
            except TimeoutError:
                pass
            backoff = min(self.config.backoff_max_s, backoff * 2)

    async def _measure_network(self) -> tuple[float, float]:
        """(upload bytes/s, rtt s) to the broker: pings, then 512 KiB echoes (assumed
        symmetric: the echo takes as long back)."""
        assert self.host is not None
        rtts = []
        for i in range(5):
            start = time.perf_counter()
            await self.host.request(self.broker_id, PING, Ping(nonce=i), timeout=10.0)
            rtts.append(time.perf_counter() - start)
        rtt = statistics.median(rtts)
        payload = b"\0" * (512 * 1024)  # under the ping protocol's 1 MiB limit
        times = []
        for i in range(3):
            start = time.perf_counter()
            await self.host.request(
                self.broker_id, PING, Ping(nonce=100 + i, payload=payload), timeout=30.0
            )
            times.append(time.perf_counter() - start)
        transfer = max(1e-6, min(times) - rtt)
        return 2 * len(payload) / transfer, rtt

    async def _on_ping(self, peer: str, msg: Ping) -> Pong:
        """The broker checks that we answer before it declares us lost (a request to us
        failed). Only the broker gets the payload echoed; others get the nonce alone, so we
        are no bandwidth reflector."""
        return Pong(nonce=msg.nonce, payload=msg.payload if peer == self.broker_id else b"")

    def _announced(self) -> list[str]:
        assert self.host is not None
        if self.config.announce:
            return announced(self.config.announce, self.host.peer_id)
        return dialable(self.host.addrs)

    async def join(self) -> None:
        """Join the broker once (raises `_Refused` with its reason)."""
        await self._join()

    async def _join(self) -> None:
        assert self.host is not None and self.profile is not None
        await self.host.connect(self.config.broker)
        up, rtt = await self._measure_network()
        profile = JoinProfile(
            gpu=self.profile.gpu,
            cpu=self.profile.cpu,
            cpu_cores=self.profile.cpu_cores,
            executors=[
                ExecutorInfo(
                    e.executor,
                    e.device,
                    dict(e.flops),
                    e.mem_bandwidth,
                    e.memory_bytes,
                    e.memory_free_bytes,
                )
                for e in self.profile.executors
            ],
            executor=self.config.executor.kind,
            memory_limit_bytes=self.memory_budget,
            net_up_bytes_s=up,
            rtt_s=rtt,
            version=_version(),
            addrs=self._announced(),
        )
        body = msgspec.json.encode(profile)
        stamp = time.time()
        signature = self.host.identity.sign(
            signed_join_bytes(body, self.broker_id, stamp), domain=JOIN_DOMAIN
        )
        reply = await self.host.request(
            self.broker_id,
            JOIN,
            Join(
                profile=body,
                signature=signature,
                broker=self.broker_id,
                timestamp=stamp,
                token=self.config.join_token,
                loaded=sorted(self.server.stages),
                boot=self.boot,
            ),
            timeout=15.0,
        )
        if not reply.accepted:
            raise _Refused(reply.reason or "the broker refused the join")
        self.heartbeat_s = max(0.2, reply.heartbeat_s)
        self.joined.set()
        _event(
            "joined",
            broker=self.broker_id,
            pool=reply.pool,
            rtt_ms=round(rtt * 1e3, 2),
            up_mb_s=round(up / 1e6, 1),
            loaded=sorted(self.server.stages),
        )

    async def heartbeat(self) -> None:
        """One heartbeat; raises `_Rejoin` if the broker does not know us."""
        assert self.host is not None
        self._seq += 1
        self.server.expire()
        self._wake.clear()  # (a wake while this heartbeat is on its way sends another)
        draining = self.server.draining
        ack = await self.host.request(
            self.broker_id,
            HEARTBEAT,
            Heartbeat(
                seq=self._seq,
                loaded=sorted(self.server.stages),
                queued=self.server.in_flight,
                kv_bytes=self.server.kv_bytes(),
                draining=draining,
            ),
            timeout=max(2.0, 2 * self.heartbeat_s),
        )
        if not ack.known:
            raise _Rejoin("the broker does not know this provider (it restarted)")
        if draining:
            self._told_draining.set()

    async def _heartbeats(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.heartbeat()
            try:
                await asyncio.wait_for(self._wake.wait(), self.heartbeat_s)
            except TimeoutError:
                pass

    # ---- assignments -----------------------------------------------------------------------

    async def _on_assign(self, peer: str, request: Assign | Unassign | Promote) -> AssignAck:
        if peer != self.broker_id:
            return AssignAck(accepted=False, reason="only the broker assigns stages")
        if isinstance(request, Unassign):
            self._cancel_load(request.key)
            stage = self.server.remove(request.key)
            if stage is not None:
                self.cache.pinned.discard(stage.info.sha256)
            _event("unassigned", key=request.key)
            return AssignAck(accepted=True)
        if isinstance(request, Promote):
            ok = self.server.promote(request.key)
            _event("promoted", key=request.key, ok=ok)
            return AssignAck(accepted=ok, reason="" if ok else f"{request.key} is not loaded")
        if self.server.draining:
            return AssignAck(accepted=False, reason="this provider is leaving")
        try:
            info = stage_of(request)
        except StageRefused as exc:
            return AssignAck(accepted=False, reason=str(exc))
        existing = self.server.stages.get(request.key)
        if existing is not None and existing.info.sha256 == info.sha256:
            existing.role = request.role  # already loaded: a role change or a re-send
            self._spawn_status(StageStatus(key=request.key, state="ready", role=request.role))
            return AssignAck(accepted=True)
        pending = self._pending.get(request.key)
        if pending is not None and pending == request:
            return AssignAck(accepted=True)  # the same assignment, still loading
        self._cancel_load(request.key)  # a different assignment under this key replaces it
        replaced = existing.info.sha256 if existing is not None else None
        need = memory_needed(info)
        free = self.memory_budget - self.used_memory()
        if replaced is None and need > free:
            return AssignAck(
                accepted=False,
                reason=f"stage {request.key} needs about {human_bytes(need)}; "
                f"{human_bytes(max(0, free))} of this provider's memory budget is left",
            )
        self._reserved[request.key] = need
        self._pending[request.key] = request
        self.loading[request.key] = asyncio.create_task(self._load(request))
        return AssignAck(accepted=True)

    def _cancel_load(self, key: str) -> None:
        task = self.loading.pop(key, None)
        if task is not None:
            task.cancel()
        self._reserved.pop(key, None)
        self._pending.pop(key, None)

    async def _load(self, request: Assign) -> None:
        _event("assigned", key=request.key, role=request.role, url=request.url)
        label = f"stage {request.key}"
        progress = _throttled_progress(label)
        me = asyncio.current_task()
        try:
            stage: LoadedStage = await host(
                request,
                self.cache,
                self.config.executor,
                self.memory_budget,
                0,  # the assignment checked and reserved the memory
                session=self._http,
                progress=progress,
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any failure: the broker hears it, with the reason
            reason = str(exc) if isinstance(exc, StageRefused) else f"{type(exc).__name__}: {exc}"
            _event("stage_failed", key=request.key, reason=reason)
            await self._report(StageStatus(key=request.key, state="failed", reason=reason))
            return
        finally:
            if self.loading.get(request.key) is me:
                self.loading.pop(request.key, None)
                self._reserved.pop(request.key, None)
                self._pending.pop(request.key, None)
        old = self.server.remove(stage.key)  # a replaced stage: its sessions go with it
        if old is not None and old.info.sha256 != stage.info.sha256:
            self.cache.pinned.discard(old.info.sha256)
        self.server.add(stage)
        _event("stage_ready", key=stage.key, role=stage.role, load_s=round(stage.load_s, 3))
        await self._report(
            StageStatus(key=stage.key, state="ready", role=stage.role, load_s=stage.load_s)
        )

    def _spawn_status(self, status: StageStatus) -> None:
        task = asyncio.create_task(self._report(status))
        self._status_tasks.add(task)
        task.add_done_callback(self._status_tasks.discard)

    async def _report(self, status: StageStatus) -> None:
        if self.host is None:
            return
        try:
            await self.host.request(self.broker_id, STAGE_STATUS, status, timeout=10.0)
        except (RemoteError, ConnectionLost, RequestTimeout, P2PError) as exc:
            # The broker learns the state from the next heartbeat's `loaded` list instead.
            _event("status_not_delivered", key=status.key, error=str(exc))

    # ---- status ----------------------------------------------------------------------------

    async def _status_line(self, stop: asyncio.Event) -> None:
        every = self.config.status_every_s
        if every <= 0 or not sys.stderr.isatty():
            return
        while not stop.is_set():
            stages = self.server.stages.values()
            active = sum(1 for s in stages if s.role == "active")
            line = (
                f"{'joined' if self.joined.is_set() else 'joining'} | stages {len(stages)} "
                f"({active} serving, {len(self.loading)} loading) | in flight "
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


def announced(announce: tuple[str, ...], peer_id: str) -> list[str]:
    """`--announce` addresses, each ending in /p2p/<our peer id>."""
    return [a if "/p2p/" in a else f"{a.rstrip('/')}/p2p/{peer_id}" for a in announce]


def dialable(addrs: list[str]) -> list[str]:
    """Listen addresses as others can dial them: one on 0.0.0.0 becomes one per IPv4
    address of this machine's interfaces (clients open sessions to them), loopback last."""
    import socket

    import psutil

    out: list[str] = []
    for addr in addrs:
        if not addr.startswith("/ip4/0.0.0.0/"):
            out.append(addr)
            continue
        rest = addr[len("/ip4/0.0.0.0/") :]
        stats = psutil.net_if_stats()
        ips = [
            a.address
            for name, nic in psutil.net_if_addrs().items()
            if name not in stats or stats[name].isup
            for a in nic
            if a.family == socket.AF_INET and not a.address.startswith("169.254.")
        ]
        for ip in sorted(set(ips), key=lambda ip: (ip.startswith("127."), ip)):
            out.append(f"/ip4/{ip}/{rest}")
    return out or list(addrs)


def broker_peer_id(addr: str) -> str:
    """The peer id at the end of a broker multiaddr; ValueError saying what is wrong."""
    from p2p.identity import public_key_from_peer_id

    head, sep, peer = addr.rpartition("/p2p/")
    if not sep or not head.startswith("/") or not peer:
        raise ValueError(f"{addr!r} is not a multiaddr ending in /p2p/<peer id>")
    try:
        public_key_from_peer_id(peer)
    except ValueError:
        raise ValueError(f"{addr!r} does not end in a valid peer id ({peer!r})") from None
    return peer


def onnxruntime_distributions() -> list[str]:
    """The onnxruntime packages installed (CPU, CUDA and DirectML builds share one module)."""
    found = []
    for dist in ("onnxruntime", "onnxruntime-gpu", "onnxruntime-directml"):
        try:
            metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        found.append(dist)
    return found


class _Rejoin(Exception):
    pass


class _Refused(Exception):
    pass


def _throttled_progress(label: str) -> Any:
    last = [0.0]

    def report(done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - last[0] < 1.0:
            return
        last[0] = now
        _event("download", stage=label, done=done, total=total)

    return report
