"""The broker's hardware check, answered with the executor this provider serves stages with.

A joining provider prepares (`prepare`: the check's ONNX graphs loaded in its executor
and run once on one row, so the timed check pays no session start) before it sends its join;
the broker then asks `Challenge` (run it, answer the rounds done and a digest) and `Reveal`
(the answer itself) while it decides the join; `release` frees the executors' memory once
the join is answered. Only this provider's broker is answered, and one answer is kept.
"""

from __future__ import annotations

import hashlib
import threading

import numpy as np

from ir.challenge import RUN_ROUNDS, WIDTH, Work, round_graph, run
from ir.executors.base import Executor
from p2p import ErrorCode, Refused
from proto.challenge import Challenge, Committed, Reveal, Revealed
from provider.hosting import ExecutorChoice


def make_check_executor(choice: ExecutorChoice, rounds: int, start: bool) -> Executor:
    """The check's graph of `rounds` rounds in the executor `choice` names, on its device."""
    graph = round_graph(rounds, start)
    if choice.kind == "torch":
        from ir.executors.torch_exec import TorchExecutor

        return TorchExecutor(graph, device=choice.device)
    from ir.executors.ort import OrtExecutor

    return OrtExecutor(graph, providers=[choice.device] if choice.device else None)


class Checks:
    def __init__(self, choice: ExecutorChoice, broker_id: str) -> None:
        self.choice = choice
        self.broker_id = broker_id
        self._lock = threading.Lock()  # one check at a time; executors built once
        self._executors: dict[tuple[int, bool], Executor] = {}
        self._answer: tuple[bytes, bytes] | None = None  # (seed, answer) of the last check

    def _executor(self, rounds: int, start: bool) -> Executor:
        known = self._executors.get((rounds, start))
        if known is None:
            known = self._executors[(rounds, start)] = make_check_executor(
                self.choice, rounds, start
            )
        return known

    def prepare(self) -> None:
        """Load the check's graphs and run each once on one row (blocking: a thread)."""
        with self._lock:
            run(Work(b"\0" * 16, rows=1, rounds=1), self._executor, window_s=1e9)
            x, b = np.ones((1, WIDTH), np.float32), np.ones((WIDTH, WIDTH), np.float32)
            for n in (1, RUN_ROUNDS):
                self._executor(n, False).run({"x": x, "b": b})

    def release(self) -> None:
        """Drop the executors (their arenas) and the last answer."""
        with self._lock:
            self._executors.clear()
            self._answer = None

    def on_challenge(self, peer: str, msg: Challenge | Reveal) -> Committed | Revealed:
        """A compute handler (a worker thread): run a check, or send its answer."""
        if peer != self.broker_id:
            raise Refused(ErrorCode.REFUSED, "only this provider's broker may check it")
        if isinstance(msg, Reveal):
            with self._lock:
                if self._answer is None or self._answer[0] != msg.seed:
                    raise Refused(ErrorCode.NOT_FOUND, "no answer to that check is kept here")
                return Revealed(answer=self._answer[1])
        if msg.width != WIDTH:
            raise Refused(ErrorCode.REFUSED, f"this provider runs checks {WIDTH} wide")
        work = Work(msg.seed, msg.rows, msg.rounds, msg.width)
        with self._lock:
            rounds, answer = run(work, self._executor, msg.window_s)
            self._answer = (msg.seed, answer)
        return Committed(rounds=rounds, digest=hashlib.sha256(answer).digest())
