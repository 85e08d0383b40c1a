"""`fusionai broker start`, `fusionai model add|list`, `fusionai job submit|status|...`."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import Any

DEFAULT_URL = "http://127.0.0.1:7371"


def _client_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--broker", help=f"the broker's HTTP URL (default: $FUSIONAI_BROKER_URL or {DEFAULT_URL})"
    )
    p.add_argument("--api-key", help="the broker's API key (default: $FUSIONAI_API_KEY)")
    p.add_argument("--cacert", help="trust this certificate for https (default: $FUSIONAI_CACERT)")


RETRY_HELP = (
    "seconds to keep retrying a broker that cannot be reached or answers 502/503/504, as "
    "while it restarts (default 30)"
)


def add_parsers(sub: Any, dispatch: Any) -> None:
    broker = sub.add_parser("broker", help="run a broker: providers join it, clients use it")
    bsub = broker.add_subparsers(dest="broker_command", required=True, metavar="SUBCOMMAND")
    start = bsub.add_parser("start", help="run the broker until Ctrl-C")
    start.add_argument(
        "--listen", action="append", help="p2p multiaddr (default /ip4/0.0.0.0/tcp/7370)"
    )
    start.add_argument("--http", default="127.0.0.1:7371", help="HTTP API HOST:PORT (port 0: any)")
    start.add_argument(
        "--relay-port",
        type=int,
        default=0,
        help="port of the relay for providers behind NAT, on the --listen IP (default 0: any "
        "free port; open it in the firewall: providers are told it when they join)",
    )
    start.add_argument("--no-relay", action="store_true", help="run no relay")
    start.add_argument(
        "--relay-mbit", type=float, default=0.0, help="the relay's bandwidth cap (0: none)"
    )
    start.add_argument("--public-url", help="base URL providers download artifacts from")
    start.add_argument("--data-dir", help="identity, database, models (default: user data dir)")
    start.add_argument("--db", help="SQLite file (default: DATA_DIR/broker.db)")
    start.add_argument("--join-token", help="providers must present this token to join")
    start.add_argument("--allow", action="append", default=[], help="peer id allowed to join")
    start.add_argument("--deny", action="append", default=[], help="peer id refused")
    start.add_argument(
        "--trust-claims",
        action="store_true",
        help="believe providers' hardware profiles: no hardware check at join, and newcomers "
        "may take served blocks at once (machines you know; tests of placement)",
    )
    start.add_argument(
        "--claim-factor",
        type=float,
        default=4.0,
        help="cap claimed FLOP/s at this times what the join's hardware check showed",
    )
    start.add_argument(
        "--allow-link-local",
        action="store_true",
        help="accept announced link-local and cloud-metadata addresses (a lab on one link)",
    )
    start.add_argument("--heartbeat-s", type=float, default=5.0, help="heartbeat interval")
    start.add_argument("--missed-heartbeats", type=int, default=3, help="missed before dead")
    start.add_argument(
        "--metrics-every-s",
        type=float,
        default=5.0,
        help="the dashboard's charts: sample the swarm this often (an hour is kept)",
    )
    start.add_argument("--queue", choices=["fifo", "sjf-bsbf"], default="fifo")
    start.add_argument(
        "--placement",
        choices=["ours", "even"],
        default="ours",
        help="where stages go: the decision core's choice, or one pipeline split evenly over "
        "every provider (the baseline to measure it against)",
    )
    start.add_argument("--replicas", type=int, default=1, help="pipelines per model (0: auto)")
    start.add_argument(
        "--microbatch",
        type=int,
        help="sequences per microbatch of a job that names none (default: sized from the job "
        "and its route, at most 32)",
    )
    start.add_argument(
        "--in-flight",
        type=int,
        help="microbatches of one job in the pipeline at once (default: one per leg and stage "
        "of its route, and one more, at most 8)",
    )
    start.add_argument(
        "--relay",
        choices=["chain", "star"],
        default="chain",
        help="batch activations go provider to provider (chain, default) or through the broker",
    )
    start.add_argument(
        "--verify-fraction",
        type=float,
        default=0.05,
        help="share of stage tasks checked on a second provider (0: none, 1: all)",
    )
    start.add_argument(
        "--verify-share",
        type=float,
        default=0.21,
        help="share of the OpenAI endpoints' answers checked against their providers' signed "
        "commitments by a rerun here (default 0.21: a provider wrong on every answer is caught "
        "within 20 with probability 0.99; 0: none)",
    )
    start.add_argument(
        "--no-client-batching",
        dest="client_batching",
        action="store_false",
        help="the OpenAI endpoints run each answer's embedding, head and steps on its own, "
        "not in batches with the others' (to measure batching, or rule it out)",
    )
    start.add_argument(
        "--verify-tolerance",
        type=float,
        default=1e-2,
        help="relative tolerance of checked answers (of the largest magnitude)",
    )
    start.add_argument("--json", action="store_true", help="print events as JSON lines")
    start.add_argument(
        "--sessions-per-slot",
        type=float,
        default=1.0,
        help="generation sessions admitted per batch slot of a model's providers, counted "
        "across gateways (default 1: more get 429 rather than slowing the others)",
    )
    start.add_argument(
        "--max-body-mb", type=float, default=64, help="largest JSON request body (MiB)"
    )
    start.add_argument(
        "--api-key", action="append", default=[], help="HTTP clients must present this key"
    )
    start.add_argument(
        "--admin-key",
        action="append",
        default=[],
        help="this key may also add or replace models and upload artifacts (other keys only "
        "use them)",
    )
    start.add_argument(
        "--api-keys-file",
        help="a file of API keys, one per line; `KEY admin` for an admin key (anything after "
        "is a comment)",
    )
    start.add_argument("--tls-cert", help="serve HTTPS with this PEM certificate (and --tls-key)")
    start.add_argument("--tls-key", help="the certificate's PEM private key")
    start.add_argument(
        "--trace",
        help="append the decision core's inputs and decisions to this file (JSON lines), to "
        "replay with `fusionai sim --replay FILE`",
    )
    start.add_argument(
        "--tls-self-signed",
        action="store_true",
        help="serve HTTPS with a self-signed certificate made in DATA_DIR/tls (clients trust it "
        "with --cacert; providers pin it automatically)",
    )
    start.set_defaults(func=dispatch, group="broker", cmd="start")

    model = sub.add_parser("model", help="models stored by a broker")
    msub = model.add_subparsers(dest="model_command", required=True, metavar="SUBCOMMAND")
    add = msub.add_parser(
        "add",
        help="upload a model package (a directory from `ir export`); on a broker with API "
        "keys, --api-key must be an admin key",
    )
    add.add_argument("directory")
    _client_options(add)
    add.add_argument("--timeout", type=float, help=RETRY_HELP)
    add.add_argument("--json", action="store_true")
    add.set_defaults(func=dispatch, group="model", cmd="add")
    lst = msub.add_parser("list", help="models and their routes")
    _client_options(lst)
    lst.add_argument("--timeout", type=float, help=RETRY_HELP)
    lst.add_argument("--json", action="store_true")
    lst.set_defaults(func=dispatch, group="model", cmd="list")

    job = sub.add_parser("job", help="batch jobs on a broker")
    jsub = job.add_subparsers(dest="job_command", required=True, metavar="SUBCOMMAND")
    submit = jsub.add_parser("submit", help="embed the lines of a text file through the swarm")
    submit.add_argument("--model", required=True)
    submit.add_argument("--texts", required=True, help="a file with one text per line")
    submit.add_argument("--microbatch", type=int)
    submit.add_argument("--wait", action="store_true", help="wait for the job, with progress")
    submit.add_argument(
        "--timeout",
        type=float,
        help="give up after this many seconds (the job goes on); until then a broker that "
        "restarts is waited for (default: wait for the job as long as it runs, and retry an "
        "unreachable broker for 30 s)",
    )
    _client_options(submit)
    submit.add_argument("--json", action="store_true")
    submit.set_defaults(func=dispatch, group="job", cmd="submit")
    for name, text in (
        ("status", "a job's state and progress"),
        ("cancel", "cancel a job"),
        ("story", "what happened to a job: providers, retries and why"),
        ("results", "a finished job's results as JSON"),
    ):
        p = jsub.add_parser(name, help=text)
        p.add_argument("id")
        _client_options(p)
        p.add_argument("--timeout", type=float, help=RETRY_HELP)
        p.add_argument("--json", action="store_true")
        if name == "results":
            p.add_argument("--out", help="write to this file instead of stdout")
        p.set_defaults(func=dispatch, group="job", cmd=name)
    jobs = jsub.add_parser("list", help="the broker's most recent jobs")
    jobs.add_argument("--limit", type=int, default=20, help="at most this many (default 20)")
    _client_options(jobs)
    jobs.add_argument("--timeout", type=float, help=RETRY_HELP)
    jobs.add_argument("--json", action="store_true")
    jobs.set_defaults(func=dispatch, group="job", cmd="list")


def run(args: argparse.Namespace) -> int:
    if args.group == "broker":
        return start(args)
    from cli import api_cmd  # model and job commands: the SDK

    return api_cmd.run(args)


# ---- broker start ------------------------------------------------------------------------


def start(args: argparse.Namespace) -> int:
    from broker.auth import KeyFileError, check_key, load_keys, self_signed
    from broker.config import BrokerConfig
    from broker.service import Broker, default_data_dir, status_line
    from p2p import heap

    host, _, port = args.http.rpartition(":")
    if not host or not port.isdigit():
        print("error: --http must be HOST:PORT, e.g. 127.0.0.1:7371", file=sys.stderr)
        return 2
    if (
        args.heartbeat_s <= 0
        or not 0.5 <= args.metrics_every_s <= 3600
        or args.missed_heartbeats < 1
        or (args.microbatch is not None and args.microbatch < 1)
        or (args.in_flight is not None and args.in_flight < 1)
        or args.max_body_mb <= 0
        or args.sessions_per_slot <= 0
    ):
        print(
            "error: --heartbeat-s, --missed-heartbeats, --microbatch, --in-flight, "
            "--max-body-mb, --sessions-per-slot must be positive, --metrics-every-s "
            "0.5 to 3600",
            file=sys.stderr,
        )
        return 2
    data_dir = Path(args.data_dir) if args.data_dir else default_data_dir()
    try:
        keys, admin = list(args.api_key), list(args.admin_key)
        for key in keys:
            check_key(key)
        for key in admin:
            check_key(key, "--admin-key")
        if args.api_keys_file:
            more, more_admin = load_keys(Path(args.api_keys_file))
            keys, admin = keys + more, admin + more_admin
    except KeyFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not args.claim_factor >= 1:
        print("error: --claim-factor is at least 1", file=sys.stderr)
        return 2
    if not 0 <= args.verify_fraction <= 1 or not args.verify_tolerance >= 0:
        print("error: --verify-fraction is 0 to 1, --verify-tolerance at least 0", file=sys.stderr)
        return 2
    if not 0 <= args.verify_share <= 1:
        print("error: --verify-share is from 0 to 1", file=sys.stderr)
        return 2
    cert = Path(args.tls_cert) if args.tls_cert else None
    key_file = Path(args.tls_key) if args.tls_key else None
    if args.tls_self_signed:
        if cert or key_file:
            print("error: --tls-self-signed or --tls-cert/--tls-key, not both", file=sys.stderr)
            return 2
        import socket
        from urllib.parse import urlsplit

        names = [host, socket.gethostname(), socket.getfqdn()]
        if args.public_url:
            names.append(urlsplit(args.public_url).hostname or "")
        cert, key_file = self_signed(data_dir / "tls", [n for n in names if n and n != "0.0.0.0"])
    elif (cert is None) != (key_file is None):
        print("error: --tls-cert and --tls-key go together", file=sys.stderr)
        return 2
    config = BrokerConfig(
        data_dir=data_dir,
        listen=tuple(args.listen) if args.listen else ("/ip4/0.0.0.0/tcp/7370",),
        http_host=host,
        http_port=int(port),
        relay_port=None if args.no_relay else args.relay_port,
        relay_rate_bytes_s=args.relay_mbit * 1e6 / 8,
        public_url=args.public_url,
        db=Path(args.db) if args.db else None,
        join_token=args.join_token,
        allow=frozenset(args.allow),
        deny=frozenset(args.deny),
        trust_claims=args.trust_claims,
        claim_factor=args.claim_factor,
        allow_link_local=args.allow_link_local,
        heartbeat_s=args.heartbeat_s,
        missed_heartbeats=args.missed_heartbeats,
        metrics_every_s=args.metrics_every_s,
        queue_policy=args.queue,
        placement=args.placement,
        replicas=args.replicas or None,
        microbatch=args.microbatch,
        in_flight=args.in_flight,
        relay=args.relay,
        verify_fraction=args.verify_fraction,
        verify_share=args.verify_share,
        client_batching=args.client_batching,
        verify_rtol=args.verify_tolerance,
        max_body_bytes=int(args.max_body_mb * 1024**2),
        sessions_per_slot=args.sessions_per_slot,
        api_keys=tuple(keys),
        admin_keys=tuple(admin),
        tls_cert=cert,
        tls_key=key_file,
        trace=Path(args.trace) if args.trace else None,
    )

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
            except NotImplementedError:
                signal.signal(sig, lambda *_: loop.call_soon_threadsafe(stop.set))
        try:
            broker = Broker(config)
        except Exception as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if args.json:
            broker.events.sinks.append(
                lambda row: print(
                    json.dumps({"event": row.kind, **row.to_json()}, default=str), flush=True
                )
            )
        try:
            async with broker:
                # What start-up built (modules, the app, the decision core) lives as long as
                # the process: moved out of the collector's reach, a full collection no longer
                # rescans it and stalls heartbeats and the gateway's streams.
                heap.settle()
                if not args.json:
                    print(f"broker {broker.peer_id}", flush=True)
                    for addr in broker.addrs:
                        print(f"  providers join: fusionai provider start --broker {addr}")
                    print(f"  HTTP API:       {broker.http_url}", flush=True)
                    if broker.tls_sha256:
                        print(f"  TLS certificate SHA-256: {broker.tls_sha256} ({cert})")
                    if broker.keys.required:
                        print(
                            f"  API keys: {len(keys) + len(admin)}, {len(admin)} of them admin "
                            "(clients send Authorization: Bearer KEY)"
                        )
                while not stop.is_set():
                    try:
                        await asyncio.wait_for(stop.wait(), 30.0)
                    except TimeoutError:
                        if not args.json:
                            print(status_line(broker), file=sys.stderr, flush=True)
        except (OSError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        return 0

    return asyncio.run(main())
