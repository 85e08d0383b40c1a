"""The `fusionai` command. Each subcommand imports its package only when it runs."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence


def _p2p(args: argparse.Namespace) -> int:
    from cli import p2p_cmd

    handler: Callable[[argparse.Namespace], int] = getattr(p2p_cmd, args.p2p_command)
    return handler(args)


def _ir(args: argparse.Namespace) -> int:
    from cli import ir_cmd

    handler: Callable[[argparse.Namespace], int] = getattr(ir_cmd, args.ir_command)
    return handler(args)


def _sim(args: argparse.Namespace) -> int:
    from cli import sim_cmd

    return sim_cmd.run(args)


def _provider(args: argparse.Namespace) -> int:
    from cli import provider_cmd

    handler: Callable[[argparse.Namespace], int] = getattr(provider_cmd, args.provider_command)
    return handler(args)


def _broker(args: argparse.Namespace) -> int:
    from cli import broker_cmd

    return broker_cmd.run(args)


def _demo(args: argparse.Namespace) -> int:
    from cli import demo

    return demo.run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fusionai",
        description="FusionAI: a compute network of consumer GPUs.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="a broker and providers on this machine: embeddings, streamed generation, and a "
        "provider dying mid-answer",
        description="Starts a broker and providers as separate processes on 127.0.0.1, adds "
        "all-MiniLM-L6-v2 and a small decoder (built once, cached), embeds texts and streams a "
        "generation through the swarm while one provider dies, then prints a summary. Every "
        "process it started is stopped on exit.",
    )
    demo.add_argument("--providers", type=int, default=4, help="providers to start (at least 4)")
    demo.add_argument("--keep", action="store_true", help="keep the swarm up until Ctrl-C")
    demo.add_argument("--json", action="store_true", help="print the summary as JSON")
    demo.set_defaults(func=_demo)

    p2p = sub.add_parser("p2p", help="peer identity and connectivity")
    p2p_sub = p2p.add_subparsers(dest="p2p_command", required=True, metavar="SUBCOMMAND")
    data_dir_help = (
        "where the identity key lives (default: $FUSIONAI_DATA_DIR or the user data dir)"
    )

    ident = p2p_sub.add_parser("id", help="print this machine's peer id (made on first use)")
    ident.add_argument("--data-dir", help=data_dir_help)
    ident.add_argument("--json", action="store_true", help="print as JSON")
    ident.set_defaults(func=_p2p, p2p_command="identity")

    serve = p2p_sub.add_parser("serve", help="run a peer that answers pings until stopped")
    serve.add_argument("--data-dir", help=data_dir_help)
    serve.add_argument("--listen", action="append", help="multiaddr (default /ip4/0.0.0.0/tcp/0)")
    serve.add_argument("--json", action="store_true", help="print the addresses as one JSON line")
    serve.set_defaults(func=_p2p, p2p_command="serve")

    ping = p2p_sub.add_parser("ping", help="connect to a peer and measure round trips")
    ping.add_argument("addr", help="the peer's multiaddr, ending in /p2p/<peer id>")
    ping.add_argument("--data-dir", help=data_dir_help)
    ping.add_argument("--count", type=int, default=100, help="round trips (default 100)")
    ping.add_argument("--size", type=int, default=0, help="payload bytes per ping (default 0)")
    ping.add_argument("--json", action="store_true", help="print the result as JSON")
    ping.set_defaults(func=_p2p, p2p_command="ping")
    from cli import ir_cmd

    ir_cmd.add_parser(sub, _ir)
    from cli import sim_cmd

    sim_cmd.add_parser(sub, _sim)
    from cli import provider_cmd

    provider_cmd.add_parser(sub, _provider)
    from cli import broker_cmd

    broker_cmd.add_parsers(sub, _broker)
    from cli import client_cmd

    client_cmd.add_parsers(sub)
    from cli import chat_cmd

    chat_cmd.add_parser(sub)
    from cli import gateway_cmd

    gateway_cmd.add_parsers(sub)
    from cli import train_cmd

    train_cmd.add_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        result: int = args.func(args)
    except KeyboardInterrupt:
        return 130
    return result


if __name__ == "__main__":
    sys.exit(main())
