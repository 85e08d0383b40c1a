"""What the parts of `AsyncClient` (`client/generating.py`, `client/finetuning.py`) use of
each other, declared once for the type checker; at run time this class is empty and
`AsyncClient` (`client/api.py`) provides every member."""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from client.http import Retry
from client.stages import ClientStages
from client.types import Job
from ir.manifest import ModelManifest
from proto.api import Model

T = TypeVar("T")

Array = np.ndarray[Any, Any]


class ClientCore:
    if TYPE_CHECKING:
        timeout: float
        cache_dir: Path
        verify_share: float  # of generations sent to the broker to be checked
        _verify_rng: random.Random
        _mux: Any  # client.stepmux.StepMux, once `_p2p` started the host
        _chains: Any  # client.chained.ChainInbox, once `_p2p` started the host (if chained)

        async def _request(
            self,
            method: str,
            path: str,
            body: Any = None,
            *,
            timeout: float | None = None,
            raw: bool = False,
            data: bytes | Path | None = None,
            retry: Retry | None = None,
            deadline: float | None = None,
        ) -> Any: ...
        async def _call(
            self, method: str, path: str, answer: type[T], body: Any = None, **options: Any
        ) -> T: ...
        async def _p2p(self) -> Any: ...
        async def _direct(self, peer: str) -> None: ...
        async def _fetch(self, path: Path, sha: str, url: str = "", what: str = "") -> None: ...
        async def _default_model(self, decoder: bool) -> str: ...
        async def _adapter_tensors(self, adapter: str | Path, model: str) -> dict[str, Array]: ...
        async def stages(self, name: str) -> ClientStages: ...
        async def model(self, name: str) -> Model: ...
        async def manifest(self, name: str) -> ModelManifest: ...
        async def submit(self, job: Mapping[str, Any]) -> Job: ...
        async def job(self, job_id: str, *, wait: float = 0.0) -> Job: ...
        async def _job(self, job_id: str, wait: float, deadline: float | None) -> Job: ...
        async def _follow(
            self,
            job_id: str,
            seen: Callable[[Job], Awaitable[None]],
            *,
            timeout: float | None,
            poll: float,
            what: str = "job",
        ) -> Job: ...
        async def wait(
            self,
            job_id: str,
            *,
            timeout: float | None = None,
            poll: float = 10.0,
            progress: Callable[[Job], None] | None = None,
        ) -> Job: ...
