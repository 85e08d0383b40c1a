"""Continuous batching: decode steps of different sessions on one stage run as one executor call.

A session step arrives in a worker thread. Steps of the same stage that arrive while one of
them gathers a run (`window_s` at most, and not at all when no other session of the stage
stepped lately), or while the stage's previous run computes, run together: up to `max_batch`
sessions in one executor call. Each session keeps its own KV cache; a run pads the caches
at their end to the longest (`pad`), the stage graph's `attention_mask` marks the padding
(`ir.families.base.PaddedKeys`), so a session's answers are what they would be alone, bit for
bit on onnxruntime's CPU kernels. The run's caches stay batched (`split`): the stage outputs
each row's new keys and values, written after the row's tokens in the arrays the run was fed
(which have room for them: `ir.pipeline.next_cache`), and each session's cache is its row of
those arrays (`stage.SharedRows`). The next run of the same sessions, the common case of
sessions generating together, feeds those arrays as they are: no cache is copied in or out,
nor inside the stage. A session that runs otherwise (alone, or with other sessions) takes its
row out first. (Packages split before output the whole cache again, `present_*`: each row's
new token is then moved next to its tokens in those arrays.)

Only one-token steps of batch-1 sessions without an adapter, on stages whose graph takes the
mask, are batched (`batchable`); prompts, replays and adapters run alone, as do packages
split before the mask existed. A step's failure in a shared run fails every step of that run
with the same answer (their sessions unchanged), as a failed run alone would.

One waiting step leads: it gathers, takes a compute slot (`gate.py`), runs the batch and
hands each step its outputs; when it is done, a step still waiting leads the next run.
Every `report_s` each stage's runs are summed up in a `batches` event (runs, steps, the
largest run).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ir.pipeline import (
    CACHE_OUTPUTS,
    KEY_MASK,
    NEW_KV,
    PRESENT_KV,
    appends,
    cache_feeds,
    cache_mask,
    next_cache,
    room,
)
from ir.pipeline import batchable as graph_takes_mask
from provider.events import event
from provider.gate import ComputeGate, Priority
from provider.stage import Array, LoadedStage, Session, SharedRows

ACTIVE_S = 1.0  # a session that stepped this recently is expected back: a run waits for it
MAX_PADDING = 0.25  # a run's caches stay batched while padding is at most this share of them
REPORT_S = 2.0  # each stage's runs are reported at most this often, seconds


@dataclass(eq=False)  # compared by identity
class Step:
    """One session's step, waiting for a run."""

    session: Session
    feeds: dict[str, Array]  # its inputs but the cache and mask (hidden states, positions)
    outputs: dict[str, Array] | None = None  # once run: its row (with its new keys and
    # values when run alone; in a batch, its new cache is `shared`, or cut out: `present_*`)
    shared: tuple[SharedRows, int] | None = None  # run in a batch: its new cache, a row
    error: BaseException | None = None
    done: bool = False
    lead: bool = False  # it is to gather and run the stage's next run
    wake: threading.Event = field(default_factory=threading.Event)  # set: done, or lead
    # (the steps of one message share one, which their thread waits on)


@dataclass
class _Stats:
    runs: int = 0
    steps: int = 0
    largest: int = 0
    since: float = 0.0  # when the first of these runs ended


def batchable(stage: LoadedStage, session: Session, feeds: dict[str, Array]) -> bool:
    """Whether this step may share a run: one new token of a batch-1 session without an
    adapter, on a stage whose graph takes the attention mask over a padded cache."""
    hidden = feeds.get("hidden_states")
    return (
        graph_takes_mask(stage.info)
        and session.batch == 1
        and not session.adapters
        and hidden is not None
        and hidden.shape[:2] == (1, 1)
    )


def pad(steps: list[Step], extra: int = 0) -> dict[str, Array]:
    """One run's feeds: the steps' inputs stacked, their caches padded at the end to the
    longest (and `extra` more columns, for the new tokens of a stage that appends them), and
    the mask saying which keys hold tokens (each row's past, then its new one)."""
    lengths = [s.session.past_len for s in steps]
    width = max(lengths) + extra
    feeds = {name: np.concatenate([s.feeds[name] for s in steps]) for name in steps[0].feeds}
    caches = [s.session.peek() for s in steps]
    for name, first in caches[0].items():
        _, heads, _, dim = first.shape
        padded = np.zeros((len(steps), heads, width, dim), dtype=first.dtype)
        for row, (cache, length) in enumerate(zip(caches, lengths, strict=True)):
            padded[row, :, :length] = cache[name][0, :, :length]
        feeds[name] = padded
    feeds[KEY_MASK] = cache_mask(lengths, width, 1)
    return feeds


def shared_feeds(steps: list[Step]) -> dict[str, Array] | None:
    """One run's feeds without copying any cache, if `steps` are the sessions of one earlier
    run, every one of them, in its row order (see `order`); else None."""
    first = steps[0].session.shared
    if first is None:
        return None
    rows = first[0]
    for i, step in enumerate(steps):
        mine = step.session.shared
        if mine is None or mine[0] is not rows or mine[1] != i:
            return None
        if step.session.past_len != rows.lengths[i]:
            return None
    if len(steps) != len(rows.lengths):
        return None
    feeds = {name: np.concatenate([s.feeds[name] for s in steps]) for name in steps[0].feeds}
    width = next(iter(rows.arrays.values())).shape[2]
    feeds.update(rows.arrays)
    feeds[KEY_MASK] = cache_mask(rows.lengths, width, 1)
    return feeds


def order(steps: list[Step]) -> None:
    """Sort `steps` by their rows of an earlier run's cache, where they have one (so that a
    run of the same sessions finds them in order)."""
    steps.sort(key=lambda s: s.session.shared[1] if s.session.shared is not None else -1)


def split(
    outputs: dict[str, Array], steps: list[Step], feeds: dict[str, Array]
) -> list[dict[str, Array]]:
    """Each step's row of a run's outputs. The new caches stay batched: a stage's new keys
    and values are written after each row's tokens in the arrays the run was fed (`feeds`),
    in place where they have room; an older stage's `present_*` arrays get each row's new
    token moved next to its tokens. Each step gets its row (`Step.shared`), unless padding
    would be more than `MAX_PADDING` of the rows' tokens (sessions of very different
    lengths): then each row's cache is cut out (a copy) into its outputs, as `present_*`.
    Call with the sessions' `past_len` as the run found them."""
    lengths = [s.session.past_len for s in steps]
    rest = [
        {k: v[i : i + 1].copy() for k, v in outputs.items() if not k.startswith(CACHE_OUTPUTS)}
        for i in range(len(steps))
    ]
    if any(k.startswith(NEW_KV) for k in outputs):
        past = {k: v for k, v in feeds.items() if k.startswith("past_")}
        kept = next_cache(past, lengths, outputs)
        arrays = kept[0] if kept is not None else {}
    else:
        arrays = _moved(outputs, lengths)
    if not arrays:
        return rest
    if len(steps) * (max(lengths) + 1) > (1 + MAX_PADDING) * sum(n + 1 for n in lengths):
        for row, (mine, n) in enumerate(zip(rest, lengths, strict=True)):
            mine.update(
                {
                    PRESENT_KV + k.removeprefix("past_"): v[row : row + 1, :, : n + 1].copy()
                    for k, v in arrays.items()
                }
            )
        return rest
    row_bytes = sum(v[0].nbytes for v in arrays.values())
    shared = SharedRows(arrays, [n + 1 for n in lengths], row_bytes)
    for row, step in enumerate(steps):
        step.shared = (shared, row)
    return rest


def _moved(outputs: dict[str, Array], lengths: list[int]) -> dict[str, Array]:
    """An older stage's `present_*` caches (past_* names), each row's new token (after the
    longest past) moved next to its tokens."""
    arrays: dict[str, Array] = {}
    for name, value in outputs.items():
        if not name.startswith(PRESENT_KV):
            continue
        if not value.flags.writeable:
            value = value.copy()
        end = value.shape[2] - 1  # (the new token's column: after the longest past)
        for row, length in enumerate(lengths):
            if length < end:
                value[row, :, length] = value[row, :, end]
        arrays["past_" + name.removeprefix(PRESENT_KV)] = value
    return arrays


class Batcher:
    """Runs batchable steps of each stage together (see the module's docstring).

    `run(stage, feeds)` executes one run's feeds (the caller's executor call, errors as it
    raises them); `gate` gives the compute slot; `clock` is monotonic seconds."""

    def __init__(
        self,
        gate: ComputeGate,
        run: Callable[[LoadedStage, dict[str, Array]], dict[str, Array]],
        *,
        max_batch: int = 16,
        window_s: float = 0.002,
        report_s: float = REPORT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if not 0 <= window_s <= 1:
            raise ValueError(f"the batch window must be 0 to 1 s, got {window_s}")
        self.gate, self._run = gate, run
        self.max_batch, self.window_s, self.clock = max_batch, window_s, clock
        self.report_s = report_s
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)  # a gathering leader waits on it
        self._waiting: dict[str, list[Step]] = {}  # stage key -> steps not yet in a run
        self._leading: set[str] = set()  # stages whose next run a step gathers or runs
        self._seen: dict[str, dict[int, float]] = {}  # stage -> id(session) -> last step
        self._stats: dict[str, _Stats] = {}

    def step(self, stage: LoadedStage, step: Step) -> dict[str, Array]:
        """Run `step` in a batch with others of `stage`; its outputs (raises its error)."""
        self.run(stage, [step])
        if step.error is not None:
            raise step.error
        assert step.outputs is not None
        return step.outputs

    def run(self, stage: LoadedStage, steps: list[Step]) -> None:
        """Run `steps` (of different sessions, one message's) in batches with others of
        `stage`; each gets its outputs or its error. This thread waits for them all, leading
        a run whenever one of them is to lead."""
        key, wake = stage.key, threading.Event()
        with self._lock:
            now = self.clock()
            for step in steps:
                step.wake = wake
                self._seen.setdefault(key, {})[id(step.session)] = now
            self._waiting.setdefault(key, []).extend(steps)
            if key in self._leading:
                self._arrived.notify()  # a gathering leader counts them
            else:
                self._leading.add(key)
                steps[0].lead = True
        while True:
            lead = next((s for s in steps if s.lead and not s.done), None)
            if lead is not None:
                self._lead(stage, lead)
            elif all(s.done for s in steps):
                return
            else:
                wake.wait()  # a run of ours is done, or one of ours leads the next
                wake.clear()

    def forget(self, session: Session) -> None:
        """A closed session is not waited for."""
        with self._lock:
            for seen in self._seen.values():
                seen.pop(id(session), None)

    def _expected(self, key: str, now: float) -> int:
        seen = self._seen.get(key, {})
        for sid in [s for s, t in seen.items() if now - t > ACTIVE_S]:
            del seen[sid]
        return min(len(seen), self.max_batch)

    def _lead(self, stage: LoadedStage, mine: Step) -> None:
        key = stage.key
        batch: list[Step] = [mine]
        try:
            with self._lock:  # gather: until every recently active session is in, or time
                end = self.clock() + self.window_s
                while len(self._waiting[key]) < self._expected(key, self.clock()):
                    left = end - self.clock()
                    if left <= 0:
                        break
                    self._arrived.wait(left)
            with self.gate.slot(Priority.SESSION):
                with self._lock:  # those that came while we waited for the slot come too
                    others = [s for s in self._waiting[key] if s is not mine]
                    batch += others[: self.max_batch - 1]
                self._execute(stage, batch)
        except BaseException as exc:
            for step in batch:
                if step.outputs is None:
                    step.error = exc
        finally:
            with self._lock:
                self._waiting[key] = [s for s in self._waiting[key] if s not in batch]
                nxt = self._waiting[key][0] if self._waiting[key] else None
                if nxt is None:
                    self._leading.discard(key)
                else:
                    nxt.lead = True  # the next run is the first waiting step's to lead
            for step in batch:
                step.done = True
                step.wake.set()
            if nxt is not None:
                nxt.wake.set()
            self._report(key, len(batch))

    def _execute(self, stage: LoadedStage, batch: list[Step]) -> None:
        if len(batch) == 1:  # alone: its cache as it is
            step = batch[0]
            session = step.session
            cache = cache_feeds(stage.info, session.cache, [session.past_len], 1)
            step.outputs = self._run(stage, {**step.feeds, **cache})
            return
        order(batch)
        feeds = shared_feeds(batch)
        if feeds is None:
            longest = max(s.session.past_len for s in batch)
            feeds = pad(batch, room(longest + 1) - longest if appends(stage.info) else 0)
        outputs = self._run(stage, feeds)
        for step, row in zip(batch, split(outputs, batch, feeds), strict=True):
            step.outputs = row

    def _report(self, key: str, size: int) -> None:
        if size:
            with self._lock:
                stats = self._stats.setdefault(key, _Stats(since=self.clock()))
                stats.runs += 1
                stats.steps += size
                stats.largest = max(stats.largest, size)
        self.report()

    def report(self) -> None:
        """A `batches` event for each stage whose runs were last reported `report_s` ago or
        more (called after each run and at the server's sweeps)."""
        now = self.clock()
        with self._lock:
            due = {k: s for k, s in self._stats.items() if now - s.since >= self.report_s}
            for key in due:
                del self._stats[key]
        for key, stats in due.items():
            event(
                "batches",
                stage=key,
                runs=stats.runs,
                steps=stats.steps,
                largest=stats.largest,
                mean=round(stats.steps / stats.runs, 2),
                seconds=round(now - stats.since, 2),
            )
