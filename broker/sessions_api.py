"""The routes clients use during a generation session: a provider for a stage
(`POST /v1/models/{name}/pick`, or a second one to check another's answers), and a report on
one that failed or disagreed (`POST /v1/providers/{peer}/report`: the broker checks it
is alive, or probes the provider itself before any quarantine)."""

from __future__ import annotations

import random

from aiohttp import web

from broker.errors import NotFound, Unavailable
from broker.httpkit import answer, body_as
from broker.jobkinds import JobError
from broker.registry import Registry
from broker.serving import Serving
from broker.verify import Verifier
from proto.api.swarm import Picked, PickRequest, Report, ReportRequest


class SessionRoutes:
    def __init__(
        self,
        serving: Serving,
        registry: Registry,
        verifier: Verifier,
        inflight: dict[str, int],
        rng: random.Random,
        request_timeout_s: float,
    ) -> None:
        self.serving = serving
        self.registry = registry
        self.verifier = verifier
        self.inflight = inflight  # stage requests outstanding per provider (shared with jobs)
        self.rng = rng  # who checks: unpredictable
        self.request_timeout_s = request_timeout_s

    async def pick(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in self.serving.plans:
            raise NotFound(f"no model named {name!r}")
        body = await body_as(request, PickRequest)
        units = len(self.serving.unit_keys(self.serving.plans[name]))
        stage, avoid = body.stage, body.avoid
        if stage >= units:
            raise JobError("stage", f"must be a provider stage position from 0 to {units - 1}")
        limit = self.request_timeout_s
        # waits longer than the broker's request timeout are cut
        wait = limit if body.timeout is None else min(body.timeout, limit)
        key = self.serving.unit_keys(self.serving.plans[name])[stage]
        if body.check:  # a provider to check another's answers: any holder of the stage, at once
            holders = self.registry.holders(key, set(avoid))
            if not holders:
                raise Unavailable(f"no other provider holds stage {stage} of {name}")
            checker = self.rng.choice(holders)  # a provider cannot know it checks or is checked
            return answer(self._picked(key, checker))
        peer = await self.serving.pick(name, stage, set(avoid), self.inflight, float(wait))
        if peer is None:
            raise Unavailable(f"no provider has served stage {stage} of {name} for {wait:g} s")
        return answer(self._picked(key, peer))

    def _picked(self, key: str, peer: str) -> Picked:
        info = self.serving.peer_info(peer)
        return Picked(key, info.peer_id, info.addrs, self.registry.reach_kind(peer))

    async def report(self, request: web.Request) -> web.Response:
        peer = request.match_info["peer"]
        body = await body_as(request, ReportRequest)
        reason, wrong = body.reason, body.wrong_output
        if wrong is None:
            await self.serving.suspect(peer, f"a client's request failed: {reason}")  # if alive
            return answer(Report(peer, self.registry.alive(peer)))
        # A client's shadow step disagreed: the broker probes the provider itself (a client's
        # word alone quarantines no one).
        name = wrong.rpartition("/")[0]
        plan = self.serving.plans.get(name)
        keys = self.serving.unit_keys(plan) if plan is not None else []
        if wrong not in keys:
            raise JobError("wrong_output", f"no provider stage {wrong!r}")
        agreed, quarantined = await self.verifier.report(peer, name, keys.index(wrong), reason)
        return answer(Report(peer, self.registry.alive(peer), agreed, quarantined))
