"""The end of a train job: the trained weights, read part by part from a replica, written as
a new package (the source package's stages with each weight replaced) and added to the broker
as a model, ready to serve."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from broker.jobkinds import JobFailed
from broker.pretrain.request import trained_name
from p2p import P2PError
from proto.pretrain import PretrainFetch, PretrainPart

if TYPE_CHECKING:
    from broker.models import StoredModel
    from broker.pretrain.run import SwarmPretrain

Array = np.ndarray[Any, Any]
READ_TIMEOUT_S = 900.0


async def export_model(run: SwarmPretrain) -> StoredModel:
    """The trained weights of `run`'s replicas as a new model of the broker."""
    from ir.pretrain_state import save_package

    weights: dict[str, Array] = {}
    for peer in list(run.members):
        try:
            weights = await read_weights(run, peer)
            break
        except (P2PError, JobFailed) as exc:
            run._drop(peer, f"could not read its weights: {exc}")
    if not weights:
        raise JobFailed("no replica could hand over the trained weights")
    name = trained_name(run.job, run.request)
    models = run.kind.models
    with tempfile.TemporaryDirectory(dir=models.incoming, prefix="train-") as tmp:
        out = Path(tmp) / "package"
        await asyncio.to_thread(
            save_package, run.model.directory, run.model.manifest, weights, out, name
        )
        for f in out.iterdir():
            if f.is_file() and f.name != "manifest.json":
                await asyncio.to_thread(_keep, models, f)
        return await run.kind.add_model((out / "manifest.json").read_bytes())


async def read_weights(run: SwarmPretrain, peer: str) -> dict[str, Array]:
    """Every weight of `peer`'s replica (`JobFailed` if it is not at the run's last step)."""
    weights: dict[str, Array] = {}
    part, parts = 0, 1
    while part < parts:
        message = PretrainFetch(job=run.job.id, part=part, weights_only=True)
        got: PretrainPart = await run._call(peer, message, READ_TIMEOUT_S)
        if got.step != run.done:
            raise JobFailed(f"replica {peer[:12]} is at step {got.step}, not {run.done}")
        parts = got.parts
        weights.update({k[2:]: t.to_numpy() for k, t in got.tensors.items()})
        part += 1
    expected = {f"{s.index}:" for s in run.model.manifest.stages}
    if not weights or any(k.split(":", 1)[0] + ":" not in expected for k in weights):
        raise JobFailed(f"replica {peer[:12]} handed over weights of another model")
    return weights


def _keep(models: Any, path: Path) -> None:
    from files.digest import sha256_file

    models.cache.put(sha256_file(path), path.read_bytes())
