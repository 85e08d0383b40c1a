"""`fusionai chat`: an interactive chat with a model through the swarm, in the terminal."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from cli.broker_cmd import _client_options

HELP = "Type a message and press Enter; Ctrl-D (or /exit) ends the chat, /reset forgets it."


def add_parser(sub: Any) -> None:
    chat = sub.add_parser(
        "chat", help="chat with a model through the swarm", description=chat_cmd.__doc__
    )
    chat.add_argument("--model", help="the model (default: the broker's only decoder)")
    chat.add_argument("--system", help="a system message opening the conversation")
    chat.add_argument(
        "-n", "--max-new-tokens", type=int, default=256, help="per answer, at most (default 256)"
    )
    chat.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    chat.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default 1)")
    chat.add_argument("--seed", type=int, help="makes sampling repeatable")
    chat.add_argument("--timeout", type=float, default=30.0, help="per-step deadline, seconds")
    _client_options(chat)
    chat.set_defaults(func=chat_cmd)


def chat_cmd(args: argparse.Namespace) -> int:
    """Chat with a model: each message and answer is kept, and the whole conversation goes
    through the model's chat template for the next answer. Answers stream as they come; a
    provider lost mid-answer is replaced without changing it (a line says so). Ctrl-C stops
    an answer (it is then left out of the conversation); Ctrl-D or Ctrl-C at the prompt ends
    the chat."""
    from client import Client, Failover, FusionAIError

    def failed(event: Failover) -> None:
        print(
            f"\n[stage {event.stage} on {event.peer[-8:]} failed ({event.reason}); resuming on a "
            "replacement]",
            file=sys.stderr,
            flush=True,
        )

    base = [{"role": "system", "content": args.system}] if args.system else []
    messages: list[dict[str, str]] = list(base)
    try:
        client = Client(args.broker, args.api_key, cacert=args.cacert, timeout=args.timeout)
    except (FusionAIError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    with client:
        try:
            name = args.model or client.default_model()
            if client.manifest(name).chat_template is None:
                raise FusionAIError(f"model {name} has no chat template: use `fusionai generate`")
        except (FusionAIError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"chatting with {name}. {HELP}", flush=True)
        while True:
            try:
                line = input("you> ")
            except (EOFError, KeyboardInterrupt):
                print(flush=True)
                return 0
            text = line.strip()
            if text in ("/exit", "/quit"):
                return 0
            if text == "/reset":
                messages = list(base)
                print("(the conversation is forgotten)", flush=True)
                continue
            if not text:
                continue
            messages.append({"role": "user", "content": line})
            answer = _answer(client, messages, name, args, failed)
            if answer is None:
                messages.pop()  # stopped or failed: the message goes unanswered
            else:
                messages.append({"role": "assistant", "content": answer})


def _answer(
    client: Any, messages: list[dict[str, str]], model: str, args: argparse.Namespace, failed: Any
) -> str | None:
    """Stream one answer to the terminal; its text, or None if stopped (Ctrl-C) or failed."""
    from client import FusionAIError

    print(f"{model}> ", end="", flush=True)
    stream = None
    try:
        stream = client.chat(
            messages,
            args.max_new_tokens,
            args.temperature,
            args.top_p,
            model=model,
            seed=args.seed,
            on_failover=failed,
        )
        for piece in stream:
            print(piece, end="", flush=True)
        print(flush=True)
        return str(stream.result.text)
    except KeyboardInterrupt:
        print("\n[stopped]", flush=True)
    except (FusionAIError, ValueError, OSError) as exc:
        print(f"\nerror: {exc}", file=sys.stderr, flush=True)
    if stream is not None:
        try:
            stream.close()
        except (FusionAIError, KeyboardInterrupt):
            pass
    return None
