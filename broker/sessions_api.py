"""The routes clients use during a generation session: a provider for a stage
(`POST /v1/models/{name}/pick`, or a second one to check another's answers), and a report on
one that failed or disagreed (`POST /v1/providers/{peer}/report`: the broker checks it
is alive, or probes the provider itself before any quarantine)."""

from __future__ import annotations

import random

from aiohttp import web

from broker.errors import NotFound, Unavailable
from broker.httpkit import json_body
from broker.jobkinds import JobError
from broker.registry import Registry
from broker.serving import Serving
from broker.verify import Verifier


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
        body = await json_body(request)
        if not isinstance(body, dict):
            raise JobError("body", "must be a JSON object")
        units = len(self.serving.unit_keys(self.serving.plans[name]))
        stage = body.get("stage")
        if type(stage) is not int or not 0 <= stage < units:
            raise JobError("stage", f"must be a provider stage position from 0 to {units - 1}")
        avoid = body.get("avoid", [])
        if not isinstance(avoid, list) or not all(isinstance(a, str) for a in avoid):
            raise JobError("avoid", "must be a list of peer ids")
        limit = self.request_timeout_s
        wait = body.get("timeout", limit)
        if type(wait) not in (int, float) or not 0 <= wait < 1e9:
            raise JobError("timeout", "must be a non-negative number of seconds")
        wait = min(wait, limit)  # waits longer than the broker's request timeout are cut
        check = body.get("check", False)
        if type(check) is not bool:
            raise JobError("check", "must be true or false")
        key = self.serving.unit_keys(self.serving.plans[name])[stage]
        if check:  # a provider to check another's answers: any holder of the stage, at once
            holders = self.registry.holders(key, set(avoid))
            if not holders:
                raise Unavailable(f"no other provider holds stage {stage} of {name}")
            checker = self.rng.choice(holders)  # a provider cannot know it checks or is checked
            return web.json_response({"key": key, **self.serving.peer_info(checker)})
        peer = await self.serving.pick(name, stage, set(avoid), self.inflight, float(wait))
        if peer is None:
            raise Unavailable(f"no provider has served stage {stage} of {name} for {wait:g} s")
        return web.json_response({"key": key, **self.serving.peer_info(peer)})

    async def report(self, request: web.Request) -> web.Response:
        peer = request.match_info["peer"]
        body = await json_body(request)
        reason = body.get("reason") if isinstance(body, dict) else None
        if not isinstance(reason, str) or not reason or len(reason) > 1000:
            raise JobError("reason", "must be a non-empty string of at most 1000 characters")
        assert isinstance(body, dict)
        wrong = body.get("wrong_output")
        if wrong is None:
            await self.serving.suspect(peer, f"a client's request failed: {reason}")  # if alive
            return web.json_response({"peer_id": peer, "alive": self.registry.alive(peer)})
        # A client's shadow step disagreed: the broker probes the provider itself (a client's
        # word alone quarantines no one).
        if not isinstance(wrong, str):
            raise JobError("wrong_output", "must name the stage key (MODEL/INDEX) it answered")
        name = wrong.rpartition("/")[0]
        plan = self.serving.plans.get(name)
        keys = self.serving.unit_keys(plan) if plan is not None else []
        if wrong not in keys:
            raise JobError("wrong_output", f"no provider stage {wrong!r}")
        agreed, quarantined = await self.verifier.report(peer, name, keys.index(wrong), reason)
        return web.json_response(
            {
                "peer_id": peer,
                "alive": self.registry.alive(peer),
                "probe_agreed": agreed,
                "quarantined": quarantined,
            }
        )
