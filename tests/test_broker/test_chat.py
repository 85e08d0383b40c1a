"""Chat through a real swarm: `/v1/chat/completions` as the `openai` package calls it, the
SDK's `chat` and `fusionai chat` in a pseudo-terminal, each giving the text transformers
gives in-process for the same messages (the chat template with the generation prompt, then
greedy `generate`), through a provider's death, stopping at either of two end-of-turn ids.
(One swarm for all of it: real processes take a while to start.)"""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

from tests.procs import ROOT
from tests.test_broker.conftest import BrokerProc, add_model, wait_ready
from tests.test_client.test_sdk import Spawner, start_providers

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(240)

HELLO = [{"role": "user", "content": "Hello world!"}]
BACKUP = [
    {"role": "system", "content": "You run on gaming PCs."},
    {"role": "user", "content": "What is a broker?"},
    {"role": "assistant", "content": "It keeps a pool of providers."},
    {"role": "user", "content": "And a backup?"},
]
N = 24


def _first_new(tokens: list[int], start: int, end: int, avoid: frozenset[int] = frozenset()) -> int:
    """The first position in start..end-1 whose token appears neither before it nor in `avoid`."""
    for i in range(start, end):
        if tokens[i] not in tokens[:i] and tokens[i] not in avoid:
            return i
    raise AssertionError(f"no fresh token in {tokens[start:end]}")


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A transformers chat model whose generation_config declares two end-of-turn ids, chosen
    so that HELLO's answer ends at one (after 4 or so tokens) and BACKUP's at the other (after
    10 or more); its package (split by `fusionai ir split`), and transformers' answers."""
    from tests.tiny_models import chat_model, hf_chat

    folder = tmp_path_factory.mktemp("chat-model")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, tok = chat_model(folder)
        hello, _ = hf_chat(model, tok, HELLO, N, None)
        backup, _ = hf_chat(model, tok, BACKUP, N, None)
        i = _first_new(hello, 2, 8)
        k = _first_new(backup, 10, N, frozenset(hello[: i + 1]))
        assert hello[i] not in backup[: k + 1]
        stops = [hello[i], backup[k]]
        model.generation_config.eos_token_id = stops
        model.generation_config.save_pretrained(folder)
        answers = {
            "hello": hf_chat(model, tok, HELLO, N, stops),
            "backup": hf_chat(model, tok, BACKUP, N, stops),
        }
    assert len(answers["hello"][0]) == i + 1 and len(answers["backup"][0]) == k + 1
    package = tmp_path_factory.mktemp("chat-pkg") / "tiny-chat"
    done = subprocess.run(
        [sys.executable, "-m", "cli.main", "ir", "split", str(folder), "--out", str(package),
         "--name", "tiny-chat"],
        cwd=ROOT, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    shown = subprocess.run(
        [sys.executable, "-m", "cli.main", "ir", "inspect", str(package)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    ).stdout  # fmt: skip
    assert f"end-of-turn token ids: {min(stops)}" in shown and "chat template (" in shown
    return {"model": model, "tok": tok, "package": package, "stops": stops, "answers": answers}


def test_openai_chat_answers_as_transformers_through_a_provider_death(
    broker: Spawner, provider: Spawner, chat: dict[str, Any], llama_package: Path
) -> None:
    b: BrokerProc = broker()
    procs = start_providers(b, provider, (), (), (), ())
    add_model(b.http, chat["package"])
    route = wait_ready(b.http, "tiny-chat", backups=1)
    client = openai.OpenAI(base_url=b.http + "/v1", api_key="unused", max_retries=0)
    tok = chat["tok"]
    prompt = tok.apply_chat_template(HELLO, tokenize=False, add_generation_prompt=True)

    # not streamed: HELLO's answer ends at the first end-of-turn id
    ids, text = chat["answers"]["hello"]
    done = client.chat.completions.create(
        model="tiny-chat", messages=HELLO, max_tokens=N, temperature=0
    )
    assert done.object == "chat.completion" and done.choices[0].message.role == "assistant"
    assert done.choices[0].message.content == text
    assert done.choices[0].finish_reason == "stop"
    assert done.usage.completion_tokens == len(ids)
    assert done.usage.prompt_tokens == len(tok(prompt, add_special_tokens=False)["input_ids"])

    # streamed, the first stage's provider killed mid-answer: BACKUP's ends at the other id
    ids, text = chat["answers"]["backup"]
    victim_id = route["stages"][0]["providers"][0]["peer_id"]
    stream = client.chat.completions.create(
        model="tiny-chat",
        messages=BACKUP,
        max_tokens=N,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        if sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 2:
            procs[victim_id].signal(signal.SIGKILL)  # mid-answer
            assert procs[victim_id].proc.wait(timeout=10) != 0
    assert chunks[0].choices[0].delta.role == "assistant"
    got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert got == text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)
    b.proc.wait_for("session_failover", lambda e: e["peer"] == victim_id, timeout=10)

    # the SDK's chat, with shadow steps checking every step on a second provider
    from client import Client

    with Client(b.http, timeout=30) as fa:
        again = fa.chat(HELLO, N, stream=False, model="tiny-chat", verify=True)
    assert again.text == chat["answers"]["hello"][1] and again.finish_reason == "stop"
    assert again.tokens == chat["answers"]["hello"][0]
    assert again.checked > 0  # the stages' backups ran the steps again and agreed
    _terminal_chat(b.http, chat)

    # what chat does not do is refused, naming the field
    refusals = [
        ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}, "messages[0]"),
        ({"messages": HELLO, "n": 2}, "n"),
        ({"messages": HELLO, "tools": [{"type": "function"}]}, "tools"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "content"),
    ]
    for extra, field in refusals:
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model="tiny-chat", **extra)  # type: ignore[call-overload]
        assert field in str(bad.value), (field, bad.value)
    add_model(b.http, llama_package)  # no chat template: refused before any session opens
    with pytest.raises(openai.BadRequestError, match="has no chat template"):
        client.chat.completions.create(model="tiny-llama", messages=HELLO)


def _terminal_chat(http: str, chat: dict[str, Any]) -> None:
    """`fusionai chat` in a pseudo-terminal: two turns typed, then Ctrl-D. Both answers are
    transformers' answers to the conversation so far, and the command exits 0."""
    from tests.tiny_models import hf_chat

    first = chat["answers"]["hello"][1]
    turns = [*HELLO, {"role": "assistant", "content": first}]
    turns.append({"role": "user", "content": "And a backup?"})
    second = hf_chat(chat["model"], chat["tok"], turns, N, chat["stops"])[1]

    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "chat", "--broker", http, "-n", str(N)],
        cwd=ROOT, stdin=slave, stdout=slave, stderr=slave, close_fds=True,
    )  # fmt: skip
    os.close(slave)
    seen = bytearray()
    try:
        mark = 0
        for line in (b"Hello world!\n", b"And a backup?\n"):
            _read_until_after(master, b"you> ", seen, mark, 60)  # the prompt
            mark = len(seen)
            os.write(master, line)
        _read_until_after(master, b"you> ", seen, mark, 60)  # the second answer, then the prompt
        os.write(master, b"\x04")  # Ctrl-D at the prompt
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    out = bytes(seen).decode("utf-8", "replace").replace("\r\n", "\n")
    assert f"tiny-chat> {first}\n" in out, out
    assert f"tiny-chat> {second}\n" in out, out


def _read_until_after(fd: int, wanted: bytes, seen: bytearray, mark: int, timeout: float) -> None:
    """Read until `wanted` appears after position `mark` of what was seen."""
    end = time.monotonic() + timeout
    while wanted not in seen[mark:]:
        left = end - time.monotonic()
        assert left > 0, f"no {wanted!r} in {bytes(seen[mark:])!r}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                data = os.read(fd, 4096)
            except OSError:  # the other side closed
                data = b""
            assert data, f"the terminal closed: {bytes(seen)!r}"
            seen += data
