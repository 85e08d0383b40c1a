"""`fusionai gateway` (the OpenAI-style endpoints as a process of their own, in front of a
broker) and `fusionai keys add|revoke|list` (managed API keys, over the broker's admin API)."""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import signal
import sys
from typing import Any

from cli.broker_cmd import _client_options


def add_parsers(sub: Any) -> None:
    gw = sub.add_parser(
        "gateway",
        help="serve the OpenAI-style endpoints in front of a broker (run any number)",
        description="A stateless process serving /v1/completions, /v1/chat/completions, "
        "/v1/embeddings and /v1/models: it runs the tokenizer, the embedding stage, the head "
        "and sampling of its users' sessions itself, and asks the broker for routes, key "
        "decisions and a lease per request. Run several behind a load balancer.",
    )
    _client_options(gw)
    gw.set_defaults(func=gateway)
    gw.add_argument("--http", default="127.0.0.1:8100", help="HOST:PORT to serve (port 0: any)")
    gw.add_argument("--name", help="this gateway's name in the broker's metrics (default: random)")
    gw.add_argument("--cache-dir", help="where models' client stages are kept")
    gw.add_argument(
        "--listen", default="/ip4/0.0.0.0/tcp/0", help="p2p multiaddr towards providers"
    )
    gw.add_argument("--timeout", type=float, default=30.0, help="per-step deadline, seconds")
    gw.add_argument(
        "--max-requests", type=int, default=256, help="requests in progress at once (default 256)"
    )
    gw.add_argument(
        "--verify-share",
        type=float,
        default=0.21,
        help="share of answers the broker checks against their providers' signed commitments "
        "(default 0.21: a provider wrong on every answer is caught within 20 with probability "
        "0.99; the broker sees the tokens of the answers checked; 0: none)",
    )
    gw.add_argument(
        "--no-client-batching",
        dest="client_batching",
        action="store_false",
        help="run each answer's embedding, head and steps on its own, not in batches with "
        "the others' (to measure batching, or rule it out)",
    )
    gw.add_argument("--json", action="store_true", help="print its URL as a JSON line")

    keys = sub.add_parser("keys", help="managed API keys: add, revoke, list (admin key)")
    ksub = keys.add_subparsers(dest="keys_command", required=True, metavar="SUBCOMMAND")
    add = ksub.add_parser("add", help="add a key (printed once: the broker keeps its hash)")
    add.add_argument("name", help="who holds it")
    add.add_argument("--role", choices=["user", "admin", "gateway"], default="user")
    add.add_argument("--max-streams", type=int, help="requests in progress at once")
    add.add_argument("--per-minute", type=int, help="requests started per minute")
    revoke = ksub.add_parser("revoke", help="revoke a key by its id")
    revoke.add_argument("id")
    listing = ksub.add_parser("list", help="the managed keys (never the keys themselves)")
    for p in (add, revoke, listing):
        _client_options(p)
        p.add_argument("--json", action="store_true", help="print the broker's answer")
        p.set_defaults(func=keys_cmd)


def gateway(args: argparse.Namespace) -> int:
    from broker.admission import Limits
    from broker.errors import Unavailable
    from client import AsyncClient
    from client.errors import FusionAIError
    from gateway.remote import KeyRefused
    from gateway.server import serve

    host, _, port = args.http.rpartition(":")
    if not host or not port.isdigit():
        print("error: --http must be HOST:PORT, e.g. 127.0.0.1:8100", file=sys.stderr)
        return 2
    if args.max_requests < 1 or args.timeout <= 0:
        print("error: --max-requests and --timeout must be positive", file=sys.stderr)
        return 2
    if not 0 <= args.verify_share <= 1:
        print("error: --verify-share is from 0 to 1", file=sys.stderr)
        return 2
    name = args.name or f"gw-{secrets.token_hex(3)}"

    def ready(url: str) -> None:
        if args.json:
            print(json.dumps({"event": "gateway_ready", "gateway": name, "http": url}), flush=True)
        else:
            print(f"gateway {name}: {url} (broker {sdk.url})", flush=True)

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        limits = Limits(requests=args.max_requests)
        try:
            await serve(
                sdk, name, host, int(port), limits, stop, ready, args.verify_share,
                args.client_batching,
            )  # fmt: skip
        except KeyRefused as exc:
            print(f"error: the broker refused this gateway's key ({exc}): give it a key "
                  "made with `fusionai keys add NAME --role gateway`", file=sys.stderr)  # fmt: skip
            return 1
        except (FusionAIError, Unavailable, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        return 0

    try:
        sdk = AsyncClient(
            args.broker, args.api_key, cacert=args.cacert, timeout=args.timeout,
            cache_dir=args.cache_dir, listen=args.listen,
        )  # fmt: skip
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(main())


def keys_cmd(args: argparse.Namespace) -> int:
    from client import AsyncClient
    from client.errors import FusionAIError
    from proto.api.keys import KeyCreated, KeyInfo, KeyList, KeyRequest

    async def call(fa: AsyncClient) -> Any:
        if args.keys_command == "add":
            body = KeyRequest(args.name, args.role, args.max_streams, args.per_minute)
            return await fa._call("POST", "/v1/keys", KeyCreated, body)
        if args.keys_command == "revoke":
            return await fa._call("DELETE", f"/v1/keys/{args.id}", KeyInfo)
        return await fa._call("GET", "/v1/keys", KeyList)

    async def main() -> Any:
        async with AsyncClient(args.broker, args.api_key, cacert=args.cacert) as fa:
            return await call(fa)

    for flag in ("max_streams", "per_minute"):
        value = getattr(args, flag, None)
        if value is not None and value < 1:
            print(f"error: --{flag.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    try:
        out = asyncio.run(main())
    except FusionAIError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        import msgspec

        print(msgspec.json.encode(out).decode())
    elif isinstance(out, KeyCreated):
        print(f"{out.key}\n  id {out.info.id}, role {out.info.role} (shown once: keep it)")
    elif isinstance(out, KeyInfo):
        print(f"revoked {out.id} ({out.name})")
    else:
        for i in out.data:
            state = "revoked" if i.revoked is not None else "in use"
            limits = f"streams {i.max_streams or '-'}, per minute {i.per_minute or '-'}"
            print(f"{i.id}  {i.role:7}  {state:7}  {limits}  {i.name}")
    return 0
