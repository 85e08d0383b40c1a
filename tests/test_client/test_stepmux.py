"""The client's step multiplexer over real p2p hosts: steps of several sessions to one provider
go as one message and each gets its own answer or error; a provider of an earlier release
(which does not know `SessionSteps`) gets them one by one with the same answers."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from client.stepmux import StepMux
from ir.errors import ExecutorError
from ir.executors.ort import OrtExecutor
from ir.package import load_package
from p2p import ErrorCode, Host, HostConfig, RemoteError, Tensor
from p2p.codec import ProtocolSpec
from proto.session import (
    SESSION,
    SessionClose,
    SessionClosed,
    SessionOpen,
    SessionOpened,
    SessionOutput,
    SessionStep,
    SessionSteps,
)
from provider.serving import Server
from provider.stage import LoadedStage

pytestmark = pytest.mark.timeout(120)
LOCAL = ("/ip4/127.0.0.1/tcp/0",)
# the session protocol as an earlier release knew it: no SessionSteps
EARLIER = ProtocolSpec(
    SESSION.protocol_id,
    request=(SessionOpen, SessionStep, SessionClose),
    response=(SessionOpened, SessionOutput, SessionClosed),
    max_message_bytes=SESSION.max_message_bytes,
)


def _server(package: Path) -> Server:
    loaded = load_package(package, stages=[1])
    info = loaded.manifest.stages[1]
    server = Server()
    server.add(LoadedStage("m/1", info, OrtExecutor(loaded.models[1], threads=1), "active"))
    return server


def _step(sid: str, token: int) -> SessionStep:
    rng = np.random.default_rng(token)
    inputs = {
        "hidden_states": rng.standard_normal((1, 1, 128)).astype(np.float32),
        "position_ids": np.zeros((1, 1), dtype=np.int64),
    }
    return SessionStep(
        session=sid, stage="m/1", inputs={k: Tensor.from_numpy(v) for k, v in inputs.items()}
    )


async def test_steps_travel_together_and_an_earlier_provider_gets_them_one_by_one(
    llama3_packages: dict[str, Path],
) -> None:
    package = llama3_packages["fp32"]
    answers: dict[str, list[Any]] = {}
    async with (
        Host(HostConfig(listen=LOCAL)) as current,
        Host(HostConfig(listen=LOCAL)) as earlier,
        Host(HostConfig(listen=LOCAL)) as client,
    ):
        current.add_compute_handler(SESSION, _server(package).session)
        earlier.add_compute_handler(EARLIER, _server(package).session)
        mux = StepMux(client)
        for name, host in [("current", current), ("earlier", earlier)]:
            peer = await client.connect(host.addrs[0])
            for i in range(4):
                await client.request(peer, SESSION, SessionOpen(session=f"s{i}", stage="m/1"))
            sent = mux.messages
            steps = [mux.step(peer, _step(f"s{i}", i), 20) for i in range(4)]
            steps.append(mux.step(peer, _step("nobody", 9), 20))  # never opened
            answers[name] = await asyncio.gather(*steps, return_exceptions=True)
            assert mux.messages == sent + 1  # one message for the five (the earlier: refused)
            with pytest.raises(RemoteError) as twice:  # a session's step twice in one message
                await client.request(peer, SESSION, SessionSteps(steps=[_step("s0", 1)] * 2))
            assert twice.value.code == (
                ErrorCode.REFUSED if name == "current" else ErrorCode.BAD_REQUEST
            )
        assert earlier.peer_id in mux._single and current.peer_id not in mux._single
    for name, got in answers.items():
        *outputs, missing = got
        assert isinstance(missing, RemoteError) and missing.code == ErrorCode.NOT_FOUND, name
        assert [o.session for o in outputs] == ["s0", "s1", "s2", "s3"]
        assert all(isinstance(o, SessionOutput) and o.past_len == 1 for o in outputs)
    for a, b in zip(answers["current"][:4], answers["earlier"][:4], strict=True):
        x, y = a.outputs["hidden_states_out"].to_numpy(), b.outputs["hidden_states_out"].to_numpy()
        assert np.array_equal(x, y)  # the same answers, batched or one by one


async def test_short_embeddings_and_heads_run_on_the_loop_with_the_rows_a_thread_gives(
    llama3_packages: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first run of each kind goes to a worker thread and is timed; later runs expected to
    take less than `INLINE_S` run on the event loop, giving each row what it gets alone, and
    the others in a thread. (The bound is set here so that this machine's load, which can
    stretch a timed run many times over, does not decide which way a run goes.)"""
    import client.stepmux
    from client.stages import ClientStages

    stages = ClientStages(llama3_packages["fp32"])
    mux = StepMux(None)  # type: ignore[arg-type]  # (no steps sent: no host needed)
    ids = [np.array([[t]], dtype=np.int64) for t in (5, 17, 300)]
    positions = np.zeros((1, 1), dtype=np.int64)
    alone = [stages.embed(i, positions) for i in ids]

    async def round_trip() -> None:  # an embedding and a head of the three, as batches
        rows = await asyncio.gather(
            *(mux.embed(stages, i, positions, f"s{n}") for n, i in enumerate(ids))
        )
        assert all(np.array_equal(r, a) for r, a in zip(rows, alone, strict=True))
        heads = await asyncio.gather(*(mux.head(stages, r) for r in rows))
        for h, r in zip(heads, rows, strict=True):
            assert np.array_equal(h, stages.head(r, np.ones((1, 1), dtype=np.int64)))

    monkeypatch.setattr(client.stepmux, "INLINE_S", 10.0)  # (every timed run is short)
    await round_trip()
    assert mux.inline == 0  # the first of each kind: in a thread, timed
    await round_trip()
    assert mux.inline == 2  # the embedding and the head on the loop
    bad = np.array([[10**6]], dtype=np.int64)  # an id outside the vocabulary: its error
    with pytest.raises(ExecutorError):  # (as the stage raises it, on the loop too)
        await mux.embed(stages, bad, positions, "s0")
    assert mux.inline == 3
    monkeypatch.setattr(client.stepmux, "INLINE_S", 0.0)  # (no run is short enough)
    await round_trip()
    assert mux.inline == 3  # both in a thread again
