"""Continuous batching in the serving core, in-process: sixteen sessions generating at once
through three stage servers share runs and each gets the tokens it gets alone; the stage graphs
give a padded row what the row computes alone, bit for bit, in every decoder family."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from ir.executors.ort import OrtExecutor
from ir.package import load_package
from ir.pipeline import LocalPipeline, appends
from p2p import ErrorCode, Refused, Tensor
from proto.session import (
    SessionClose,
    SessionOpen,
    SessionOutput,
    SessionOutputs,
    SessionStep,
    SessionSteps,
)
from provider import batching
from provider.batching import Batcher, Step, pad, shared_feeds, split
from provider.events import add_event_sink, remove_event_sink
from provider.gate import ComputeGate
from provider.serving import Server
from provider.stage import LoadedStage, Session
from tests.tiny_models import ROUNDING, greedy_with_gaps, same_as_alone, whole_cache_stage

pytestmark = pytest.mark.timeout(120)
Array = np.ndarray[Any, Any]
SESSIONS, NEW_TOKENS = 16, 12


@pytest.fixture
def events() -> Iterator[list[dict[str, Any]]]:
    seen: list[dict[str, Any]] = []
    add_event_sink(seen.append)
    yield seen
    remove_event_sink(seen.append)


def _tensors(feeds: dict[str, Array]) -> dict[str, Tensor]:
    return {k: Tensor.from_numpy(np.ascontiguousarray(v)) for k, v in feeds.items()}


def _generate(
    pipe: LocalPipeline, servers: list[Server], name: str, prompt: list[int]
) -> list[int]:
    """Greedy generation with the client's stages here and each provider stage on its
    server, as the SDK's session does it (one step per stage per token)."""
    embed, head = pipe.executors[0], pipe.executors[-1]
    for server in servers:
        server.session("client", SessionOpen(session=name, stage=_key(server)))
    tokens, past = list(prompt), 0
    for _ in range(NEW_TOKENS):
        ids = np.array([tokens[past:]], dtype=np.int64)
        positions = np.arange(past, len(tokens), dtype=np.int64)[None, :]
        hidden = embed.run({"input_ids": ids})["hidden_states"]
        for server in servers:
            step = SessionStep(
                session=name,
                stage=_key(server),
                inputs=_tensors({"hidden_states": hidden, "position_ids": positions}),
            )
            out = server.session("client", step)
            assert isinstance(out, SessionOutput) and out.past_len == len(tokens)
            hidden = out.outputs["hidden_states_out"].to_numpy()
        past = len(tokens)
        tokens.append(int(np.argmax(head.run({"hidden_states": hidden})["logits"][0, -1])))
    for server in servers:
        server.session("client", SessionClose(session=name, stage=_key(server)))
    return tokens[len(prompt) :]


def _key(server: Server) -> str:
    return next(iter(server.stages))


def _servers(package: Path, **options: Any) -> list[Server]:
    """One server per provider stage, as on three providers."""
    loaded = load_package(package)
    servers = []
    for info in loaded.manifest.stages[1:-1]:
        server = Server(**options)
        executor = OrtExecutor(loaded.models[info.index], threads=1)
        server.add(LoadedStage(f"m/{info.index}", info, executor, "active"))
        server.batcher.report_s = 0.0  # an event after every run
        servers.append(server)
    return servers


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_sixteen_concurrent_sessions_share_runs_and_keep_their_solo_tokens(
    llama3_packages: dict[str, Path], precision: str, events: list[dict[str, Any]]
) -> None:
    package = llama3_packages[precision]
    loaded = load_package(package)
    runs = [OrtExecutor(loaded.models[s.index], threads=1) for s in loaded.manifest.stages]
    pipe = LocalPipeline(loaded.manifest, runs)
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(1, 512, size=3 + i)] for i in range(SESSIONS)]
    solo = [greedy_with_gaps(package, p, NEW_TOKENS) for p in prompts]
    servers = _servers(package, max_batch=SESSIONS, batch_window_s=0.005)
    got = _concurrently(pipe, servers, prompts)
    for i, (tokens, gaps) in enumerate(solo):
        assert same_as_alone(got[i], tokens, gaps, ROUNDING[precision]), (
            precision,
            i,
            got[i],
            tokens,
        )
    runs = [e for e in events if e["event"] == "batches"]
    assert {e["stage"] for e in runs} == {_key(s) for s in servers}
    assert max(e["largest"] for e in runs) > 1, runs  # runs held several sessions
    assert all(s.kv_bytes() == 0 and not s.sessions for s in servers)


def _concurrently(
    pipe: LocalPipeline, servers: list[Server], prompts: list[list[int]]
) -> dict[int, list[int]]:
    """Each prompt's generation, all at once (a thread each)."""
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            got[i] = _generate(pipe, servers, f"s{i}", prompts[i])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not errors, errors
    return got


def test_stages_that_output_their_whole_cache_still_generate_alone_and_batched(
    llama3_packages: dict[str, Path], events: list[dict[str, Any]]
) -> None:
    """Packages split before stages output only their new keys and values output the whole
    cache again (`present_*`): the provider and the local pipeline still run them, alone and
    in batches, to the same tokens."""
    loaded = load_package(llama3_packages["fp32"])
    manifest = loaded.manifest
    runs = [OrtExecutor(loaded.models[s.index], threads=1) for s in manifest.stages]
    olds = [whole_cache_stage(loaded.models[s.index], s) for s in manifest.stages[1:-1]]
    stages = [manifest.stages[0], *(info for _, info in olds), manifest.stages[-1]]
    old = msgspec.structs.replace(manifest, stages=stages)
    old_runs = [runs[0], *(OrtExecutor(m, threads=1) for m, _ in olds), runs[-1]]
    assert all(not appends(s) for s in stages[1:-1])
    prompts = [[5, 17, 42, 7], [9, 3], [100, 200, 300, 400, 500, 11, 12]]
    want = [LocalPipeline(manifest, runs).generate_greedy(p, NEW_TOKENS) for p in prompts]
    assert [LocalPipeline(old, old_runs).generate_greedy(p, NEW_TOKENS) for p in prompts] == want
    servers = []
    for info, executor in zip(stages[1:-1], old_runs[1:-1], strict=True):
        server = Server(max_batch=4, batch_window_s=0.005)
        server.add(LoadedStage(f"m/{info.index}", info, executor, "active"))
        server.batcher.report_s = 0.0
        servers.append(server)
    got = _concurrently(LocalPipeline(manifest, runs), servers, prompts)
    assert [got[i] for i in range(len(prompts))] == want
    assert max(e["largest"] for e in events if e["event"] == "batches") > 1
    assert all(s.kv_bytes() == 0 and not s.sessions for s in servers)


@pytest.mark.parametrize("kept", [True, False])
def test_a_padded_batch_computes_each_row_as_alone_bit_for_bit(
    llama3_packages: dict[str, Path], kept: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows of different lengths padded into one run: each row's hidden states and new cache
    equal its run alone exactly, for fp32 and fp16 stages; and so does a second run, straight
    on the first run's batched caches where they were kept batched (no copy in or out), else
    on the rows cut out of them (the padding was too much to keep)."""
    monkeypatch.setattr(batching, "MAX_PADDING", 100.0 if kept else 0.0)
    rng = np.random.default_rng(5)
    for package in llama3_packages.values():
        loaded = load_package(package)
        info = loaded.manifest.stages[2]
        executor = OrtExecutor(loaded.models[info.index], threads=1)
        dtype = next(i.dtype for i in info.inputs if i.name == "hidden_states")
        steps = []
        for length in [1, 2, 3, 4, 7, 8, 11, 30]:  # every remainder of the kernels' blocks
            cache = {}
            for i in info.inputs:
                if i.name.startswith("past_"):
                    cache[i.name] = rng.standard_normal((1, 2, length, 32)).astype(dtype)
            session = Session("p", "m/2", 1, cache, past_len=length)
            feeds = {
                "hidden_states": rng.standard_normal((1, 1, 128)).astype(dtype),
                "position_ids": np.array([[length]]),
            }
            steps.append(Step(session, feeds))
        for second in (False, True):
            want = [_alone(executor, step) for step in steps]  # (reads a shared row)
            feeds = shared_feeds(steps)
            assert (feeds is not None) == (second and kept)  # then it copies no cache
            if feeds is None:
                feeds = pad(steps, extra=40)
            arrays = {k: v for k, v in feeds.items() if k.startswith("past_")}
            batched = split(executor.run(feeds), steps, feeds)
            for step, row, (outputs, cache) in zip(steps, batched, want, strict=True):
                session = step.session
                if kept:
                    assert step.shared is not None
                    rows, i = step.shared
                    assert all(rows.arrays[k] is v for k, v in arrays.items())  # in place
                    got = rows.row(i)
                    session.kv, session.shared = {}, step.shared  # as the server keeps it
                else:
                    assert step.shared is None
                    got = {
                        n.replace("present_", "past_"): v
                        for n, v in row.items()
                        if n.startswith("present_")
                    }
                    session.cache = got
                row = {n: v for n, v in row.items() if not n.startswith("present_")}
                assert outputs.keys() == row.keys() and cache.keys() == got.keys()
                for name, value in [*outputs.items(), *cache.items()]:
                    mine = row.get(name, got.get(name))
                    assert np.array_equal(value, mine), (package.name, session.past_len, name)
                session.past_len += 1
                step.feeds = {
                    "hidden_states": rng.standard_normal((1, 1, 128)).astype(dtype),
                    "position_ids": np.array([[session.past_len]]),
                }


def _alone(executor: OrtExecutor, step: Step) -> tuple[dict[str, Array], dict[str, Array]]:
    """A step run alone, unpadded: its outputs but its new keys and values, and its cache
    after it (its tokens, then the new ones)."""
    n = step.session.past_len
    outputs = executor.run(pad([step]))
    cache = {
        name: np.concatenate([value[:, :, :n], outputs[name.replace("past_", "new_")]], axis=2)
        for name, value in step.session.peek().items()
    }
    return {k: v for k, v in outputs.items() if not k.startswith("new_")}, cache


def test_steps_are_checked_one_at_a_time_per_session_and_bad_ones_fail_alone(
    llama3_packages: dict[str, Path],
) -> None:
    (server,) = _servers(llama3_packages["fp32"], max_batch=4)[:1]
    key = _key(server)
    server.session("c", SessionOpen(session="a", stage=key))
    bad = SessionStep(
        session="a",
        stage=key,
        inputs=_tensors(
            {
                "hidden_states": np.zeros((1, 1, 64), dtype=np.float32),  # not 128 wide
                "position_ids": np.zeros((1, 1), dtype=np.int64),
            }
        ),
    )
    with pytest.raises(Refused, match="hidden_states"):
        server.session("c", bad)
    mask = SessionStep(
        session="a",
        stage=key,
        inputs=_tensors({"attention_mask": np.ones((1, 1), dtype=np.int64)}),
    )
    with pytest.raises(Refused, match="keeps"):
        server.session("c", mask)
    session = server.sessions[("c", key, "a")]
    with (
        server._admit("c", stepping=session),
        pytest.raises(Refused) as twice,
        server._admit("c", stepping=session),
    ):
        pass
    assert twice.value.code == ErrorCode.BUSY and not session.stepping
    with pytest.raises(ValueError, match="max_batch"):
        Batcher(ComputeGate(), lambda stage, feeds: feeds, max_batch=0)


def test_sessions_of_a_peer_gone_at_two_sweeps_are_dropped(
    llama3_packages: dict[str, Path],
) -> None:
    (server,) = _servers(llama3_packages["fp32"])[:1]
    key = _key(server)
    for peer, sid in [("a", "1"), ("a", "2"), ("b", "3")]:
        server.session(peer, SessionOpen(session=sid, stage=key))
    assert server.disconnected({"a", "b"}) == {}
    assert server.disconnected({"b"}) == {}  # gone once: a blip, perhaps
    assert server.disconnected({"a", "b"}) == {}  # back
    assert server.disconnected({"b"}) == {}
    assert server.disconnected({"b"}) == {"a": 2}  # gone twice in a row
    assert {k[0] for k in server.sessions} == {"b"}


def test_batched_caches_are_counted_as_they_are_held_and_given_back_at_close(
    llama3_packages: dict[str, Path],
) -> None:
    """Two sessions' steps in one message leave their caches batched (each counted with its
    row's padding); one then stepping alone takes its row out; closing both gives every byte
    back to the KV budget."""
    (server,) = _servers(llama3_packages["fp32"], max_batch=4)[:1]
    key = _key(server)
    rng = np.random.default_rng(9)

    def step(sid: str, tokens: int, at: int) -> SessionStep:
        feeds = {
            "hidden_states": rng.standard_normal((1, tokens, 128)).astype(np.float32),
            "position_ids": np.arange(at, at + tokens)[None, :],
        }
        return SessionStep(session=sid, stage=key, inputs=_tensors(feeds), past=at)

    for sid, prompt in (("a", 5), ("b", 4)):
        server.session("c", SessionOpen(session=sid, stage=key))
        server.session("c", step(sid, prompt, 0))
    alone = server.kv_bytes()
    out = server.session("c", SessionSteps(steps=[step("a", 1, 5), step("b", 1, 4)]))
    assert isinstance(out, SessionOutputs) and [o.past_len for o in out.outputs] == [6, 5]
    a, b = (server.sessions[("c", key, s)] for s in "ab")
    assert a.shared is not None and b.shared is not None and a.shared[0] is b.shared[0]
    held = sum(v.nbytes for v in a.shared[0].arrays.values())
    trails = a.trail_bytes + b.trail_bytes
    assert server.kv_bytes() == held + trails > alone  # the padding of b's row counted too
    server.session("c", step("a", 1, 6))  # alone: its row taken out
    assert a.shared is None and a.past_len == 7
    assert server.kv_bytes() == sum(v.nbytes for v in a.kv.values()) + a.trail_bytes + b.counted
    for sid in "ab":
        server.session("c", SessionClose(session=sid, stage=key))
    assert server.kv_bytes() == 0 and not server.sessions
