"""Managed keys over the admin API, and what gateway processes ask of the broker.

GET    /v1/keys               the managed keys (never the keys themselves)   admin
POST   /v1/keys               a new key, shown once                          admin
DELETE /v1/keys/{id}          revoke it: refused at once here, and by
                              gateways within `DECISION_TTL_S`               admin
POST   /v1/gateway/keys       a key's decision, for a gateway to cache       gateway
POST   /v1/gateway/admit      a lease on one request of a user's key         gateway
POST   /v1/gateway/release    its end                                        gateway
POST   /v1/gateway/report     a gateway's leases still held and its traffic  gateway
"""

from __future__ import annotations

from aiohttp import web

from broker.gateways import Gateways
from broker.httpkit import answer, body_as, error
from broker.jobkinds import JobError
from broker.keystore import DECISION_TTL_S, KeyStore
from broker.leases import LOCAL, REPORT_EVERY_S, Leases
from proto.api.keys import (
    AdmitRequest,
    Admitted,
    Decision,
    GatewayReport,
    KeyCreated,
    KeyList,
    KeyQuery,
    KeyRequest,
    Release,
    Released,
    ReportAck,
)

KEY_REFUSED = "this API key is not valid (unknown, or revoked)"


class KeyRoutes:
    def __init__(self, keys: KeyStore, leases: Leases, gateways: Gateways) -> None:
        self.keys = keys
        self.leases = leases
        self.gateways = gateways

    async def list(self, request: web.Request) -> web.Response:
        return answer(KeyList(self.keys.list()))

    async def add(self, request: web.Request) -> web.Response:
        key, info = self.keys.add(await body_as(request, KeyRequest))
        return answer(KeyCreated(key, info), status=201)

    async def revoke(self, request: web.Request) -> web.Response:
        return answer(self.keys.revoke(request.match_info["id"]))

    async def decide(self, request: web.Request) -> web.Response:
        body = await body_as(request, KeyQuery)
        holder = self.keys.holder(body.key)
        if holder is None:
            return answer(Decision(not self.keys.required, DECISION_TTL_S))
        return answer(Decision(True, DECISION_TTL_S, holder.role, holder.id))

    async def admit(self, request: web.Request) -> web.Response:
        body = await body_as(request, AdmitRequest)
        if body.gateway == LOCAL:
            raise JobError("gateway", f"the name {LOCAL!r} is the broker's own gateway's")
        holder = self.keys.holder(body.key)
        if holder is None and self.keys.required:
            return error(401, KEY_REFUSED)
        lease = self.leases.acquire(holder, body.model, body.gateway, body.session)
        return answer(Admitted(lease, self.leases.ttl_s))

    async def release(self, request: web.Request) -> web.Response:
        body = await body_as(request, Release)
        return answer(Released(self.leases.release(body.lease, body.gateway)))

    async def report(self, request: web.Request) -> web.Response:
        body = await body_as(request, GatewayReport)
        return answer(ReportAck(self.gateways.report(body), REPORT_EVERY_S))
