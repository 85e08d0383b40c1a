"""Pre-training a whole model package: one data-parallel replica, and what a step does.

A `Replica` runs every stage of a package (the client's embedding and head, the providers'
blocks) as torch modules whose weights are all trainable parameters (`OnnxModule(...,
trainable=True)`), on whole sequences with no KV cache, and takes AdamW steps. The package
should come from a trainable export (`ir.export.build_package(..., trainable=True)`): a plain
export merges weights of equal value, which would then train as one.

`DataParallel` is one replica's side of a run of K: each global batch (rows drawn from
(seed, step) alone) is cut into K contiguous shards; a replica's gradient is scaled by 1 / the
global batch's tokens, so the K gradients *add up* to the global mean gradient, whatever K is.
The compressor (`ir.compress`) and an all-reduce given by the caller (`dag.collective`: queues
in one process, the p2p layer between providers) make the sum; every replica applies the same
result and stays identical. With `outer_every` = H it runs DiLoCo instead (arXiv:2311.08105, as
INTELLECT-1 ran it): H local AdamW steps on the replica's own shards, then the replicas'
pseudo-gradients (weights at the last outer step minus the weights now) are averaged, through
the same compressor, and an outer SGD step with Nesterov momentum (lr 0.7, momentum 0.9, the
paper's) moves the shared weights.

The learning-rate schedule (linear warm-up, cosine decay to 10 %) depends on the step alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ir.compress import AllReduce, Compressor, Plain, reduce
from ir.errors import PretrainError
from ir.package import Package, load_package
from ir.pipeline import KEY_MASK

__all__ = ["DataParallel", "PretrainError", "Replica", "lr_at", "shard"]

Array = np.ndarray[Any, Any]
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9


def lr_at(step: int, lr: float, warmup: int, total: int) -> float:
    """The learning rate of step `step` (1-based): linear warm-up over `warmup` steps, then a
    cosine decay to a tenth of `lr` at step `total`."""
    if warmup and step <= warmup:
        return lr * step / warmup
    span = max(total - warmup, 1)
    done = min(max(step - warmup, 0) / span, 1.0)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))


def shard(rows: Array, rank: int, size: int) -> Array:
    """Replica `rank`'s contiguous share of a global batch's rows (sizes differ by one at most)."""
    bounds = np.linspace(0, len(rows), size + 1).round().astype(int)
    return rows[bounds[rank] : bounds[rank + 1]]


class Replica:
    """Every stage of a package, all weights trainable, with AdamW."""

    def __init__(
        self,
        directory: Path | Package,
        *,
        lr: float = 1e-3,
        warmup: int = 10,
        total_steps: int = 1000,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
    ) -> None:
        import torch

        from ir.executors.torch_exec import OnnxModule

        package = directory if isinstance(directory, Package) else load_package(directory)
        self.directory, self.manifest = package.directory, package.manifest
        if package.manifest.family in ("bert", "onnx"):
            raise PretrainError(f"{package.manifest.family} packages are not decoders to pre-train")
        self.stages = sorted(package.manifest.stages, key=lambda s: s.index)
        self.modules = [OnnxModule(package.models[s.index], trainable=True) for s in self.stages]
        self.params: dict[str, Any] = {}
        for s, module in zip(self.stages, self.modules, strict=True):
            for onnx_name, key in module.parameter_names.items():
                self.params[f"{s.index}:{onnx_name}"] = getattr(module, key)
        if not self.params:
            raise PretrainError(f"{directory}: the package has no float32 weights to train")
        self.lr, self.warmup, self.total = lr, warmup, total_steps
        matrices = [p for p in self.params.values() if p.dim() >= 2]
        vectors = [p for p in self.params.values() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [
                {"params": matrices, "weight_decay": weight_decay},
                {"params": vectors, "weight_decay": 0.0},
            ],
            lr=lr,
            betas=betas,
        )
        self.step = 0  # optimizer steps taken

    @property
    def parameters(self) -> int:
        return sum(int(p.numel()) for p in self.params.values())

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(p.shape) for n, p in self.params.items()}

    def _logits(self, ids: Any) -> Any:
        import torch

        batch, seq = ids.shape
        positions = torch.arange(seq, dtype=torch.int64).expand(batch, seq)
        hidden = None
        for s, module in zip(self.stages, self.modules, strict=True):
            feeds: dict[str, Any] = {}
            for info in s.inputs:
                name = info.name
                if name == "input_ids":
                    feeds[name] = ids
                elif name == "hidden_states":
                    feeds[name] = hidden
                elif name == "position_ids":
                    feeds[name] = positions
                elif name == KEY_MASK:
                    feeds[name] = torch.ones((batch, seq), dtype=torch.int64)
                elif name.startswith("past_"):  # whole sequences: an empty cache
                    shape = [
                        batch if d == "batch" else (0 if isinstance(d, str) else d)
                        for d in info.shape
                    ]
                    feeds[name] = torch.zeros(shape, dtype=getattr(torch, info.dtype))
                else:
                    raise PretrainError(f"stage {s.name} needs input {name!r}")
            out = module(**feeds)
            hidden = out[s.outputs[0].name]
        return hidden

    def _loss(self, rows: Array) -> Any:
        import torch

        rows = np.asarray(rows)
        if rows.ndim != 2 or rows.shape[1] < 2 or rows.dtype != np.int64:
            raise PretrainError("rows must be int64 (batch, sequence + 1)")
        tokens = torch.from_numpy(np.array(rows, dtype=np.int64))  # (a copy: writable)
        logits = self._logits(tokens[:, :-1]).float()
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="sum"
        )

    def gradients(self, rows: Array, scale: float) -> tuple[float, dict[str, Array]]:
        """`scale` x the summed token losses of `rows`, and its gradient (by name)."""
        import torch

        if len(rows) == 0:
            return 0.0, {n: np.zeros(p.shape, np.float32) for n, p in self.params.items()}
        names = list(self.params)
        with torch.enable_grad():
            loss = self._loss(rows) * scale
            grads = torch.autograd.grad(loss, [self.params[n] for n in names])
        return float(loss.detach()), {n: g.numpy() for n, g in zip(names, grads, strict=True)}

    def evaluate(self, rows: Array) -> float:
        """The mean token loss of `rows`, without training."""
        import torch

        with torch.no_grad():
            return float(self._loss(rows)) / (len(rows) * (rows.shape[1] - 1))

    def apply(self, grads: Mapping[str, Array]) -> None:
        """One AdamW step with this gradient, at the schedule's learning rate."""
        import torch

        self.step += 1
        rate = lr_at(self.step, self.lr, self.warmup, self.total)
        for group in self.optimizer.param_groups:
            group["lr"] = rate
        for n, p in self.params.items():
            g = grads[n]
            if g.shape != tuple(p.shape):
                raise PretrainError(f"gradient of {n}: shape {g.shape}, expected {tuple(p.shape)}")
            p.grad = torch.from_numpy(np.ascontiguousarray(g, dtype=np.float32))
        self.optimizer.step()
        for p in self.params.values():
            p.grad = None

    def weights(self) -> dict[str, Array]:
        return {n: p.detach().numpy().copy() for n, p in self.params.items()}

    def set_weights(self, weights: Mapping[str, Array]) -> None:
        import torch

        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(torch.from_numpy(np.array(weights[n], dtype=np.float32)))

    def save(self, out: Path, name: str) -> Path:
        """The trained weights as a new package at `out` named `name` (`save_package`)."""
        from ir.pretrain_state import save_package

        return save_package(self.directory, self.manifest, self.weights(), out, name)


class DataParallel:
    """Replica `rank` of `size`: its step of a synchronous or DiLoCo run."""

    def __init__(
        self,
        replica: Replica,
        compressor: Compressor,
        rank: int,
        size: int,
        *,
        outer_every: int = 0,
        start_after: int = 0,
    ) -> None:
        """`start_after`: steps all-reduced uncompressed before the compressor starts."""
        if not 0 <= rank < size:
            raise PretrainError(f"rank {rank} of {size} replicas")
        self.replica, self.compressor = replica, compressor
        self.rank, self.size, self.outer_every = rank, size, outer_every
        self.outer: dict[str, Array] | None = replica.weights() if outer_every else None
        self.momentum: dict[str, Array] = {}
        self.start_after = start_after
        self.plain = Plain(compressor.shapes)
        self.sent_values = 0  # buffer values handed to all-reduces (for bytes per step)
        self.pending: tuple[str, dict[str, Array]] | None = None  # prepared, not committed
        self._prepared = 0  # the step `pending` is of
        self._saved: dict[str, Array] = {}  # the compressor's state before the prepared step
        self._before: dict[str, Any] | None = None  # the replica before a DiLoCo outer step

    async def step(self, rows: Array, seq_tokens: int, allreduce: AllReduce) -> float:
        """Train on this replica's shard of the global batch `rows`; its share of the global
        batch's mean token loss (the replicas' shares add up to it)."""
        import asyncio

        mine = shard(rows, self.rank, self.size)
        loss = await self.prepare(mine, len(rows), seq_tokens, allreduce)
        await asyncio.to_thread(self.commit)
        return loss

    async def prepare(
        self, mine: Array, total_rows: int, seq_tokens: int, allreduce: AllReduce
    ) -> float:
        """Step `replica.step + 1` on this replica's rows `mine` of a global batch of
        `total_rows`, up to the update every replica will apply; the update waits for
        `commit()` (or is dropped by `abort()`, which leaves the replica as it was). Its share
        of the global batch's mean token loss."""
        import asyncio

        if self.pending is not None:
            raise PretrainError(f"step {self._prepared} is prepared already")
        self._prepared = self.replica.step + 1
        self._saved = {k: v.copy() for k, v in self.compressor.state().items()}
        if hasattr(self.compressor, "replicas"):  # (Power-SGD's error is per replica)
            self.compressor.replicas = self.size
        if self.outer_every:  # DiLoCo: a local step on the shard, alone
            scale = 1.0 / max(len(mine) * seq_tokens, 1)
            loss, grads = await asyncio.to_thread(self.replica.gradients, mine, scale)
            share = loss * len(mine) / total_rows
            if (self.replica.step + 1) % self.outer_every:
                self.pending = ("local", grads)
                return share
            self._before = await asyncio.to_thread(self._snapshot)
            await asyncio.to_thread(self.replica.apply, grads)
            try:
                mean = await self._outer_mean(allreduce)
            except BaseException:
                await asyncio.to_thread(self._restore)
                self._before = None
                raise
            self.pending = ("outer", mean)
            return share
        scale = 1.0 / (total_rows * seq_tokens)
        loss, grads = await asyncio.to_thread(self.replica.gradients, mine, scale)
        try:
            summed = await self._reduce(grads, allreduce)
        except BaseException:
            self.compressor.load_state(self._saved)
            raise
        self.pending = ("sync", summed)
        return loss

    @property
    def prepared(self) -> int:
        """The step prepared and not yet committed (0: none)."""
        return self._prepared if self.pending is not None else 0

    @property
    def committed(self) -> int:
        """Steps committed (a prepared DiLoCo outer step has moved the replica on already)."""
        return self._prepared - 1 if self.pending is not None else self.replica.step

    def commit(self) -> None:
        """Apply the prepared step's update (every replica applies the same)."""
        if self.pending is None:
            raise PretrainError(f"no step {self.replica.step + 1} is prepared to commit")
        kind, update = self.pending
        if kind == "outer":
            self._outer_apply(update)
        else:
            self.replica.apply(update)
        self.pending, self._before = None, None

    def abort(self) -> None:
        """Drop the prepared step: the replica and its compressor are as before it."""
        if self.pending is not None and self.pending[0] == "outer":
            self._restore()
        if self.pending is not None:
            self.compressor.load_state(self._saved)
        self.pending, self._before = None, None

    def _snapshot(self) -> dict[str, Any]:
        import copy

        r = self.replica
        return {"w": r.weights(), "opt": copy.deepcopy(r.optimizer.state_dict()), "step": r.step}

    def _restore(self) -> None:
        before = self._before
        if before is not None:
            self.replica.set_weights(before["w"])
            self.replica.optimizer.load_state_dict(before["opt"])
            self.replica.step = before["step"]
        self.compressor.load_state(self._saved)

    async def _reduce(self, grads: Mapping[str, Array], allreduce: AllReduce) -> dict[str, Array]:
        async def counted(buffer: Array, wire: str) -> Array:
            self.sent_values += buffer.size
            return await allreduce(buffer, wire)

        early = self.replica.step < self.start_after
        return await reduce(self.compressor, grads, counted, self.plain if early else None)

    async def _outer_mean(self, allreduce: AllReduce) -> dict[str, Array]:
        """DiLoCo's outer step, first half: the replicas' mean pseudo-gradient."""
        outer = self.outer
        assert outer is not None
        local = self.replica.weights()
        delta = {n: (outer[n] - local[n]) / self.size for n in local}
        return await self._reduce(delta, allreduce)

    def _outer_apply(self, mean: Mapping[str, Array]) -> None:
        """DiLoCo's outer step, second half: Nesterov SGD on the shared weights."""
        outer = self.outer
        assert outer is not None
        for n, d in mean.items():
            v = self.momentum.get(n)
            v = d.copy() if v is None else OUTER_MOMENTUM * v + d
            self.momentum[n] = v
            outer[n] = outer[n] - OUTER_LR * (d + OUTER_MOMENTUM * v)
        self.replica.set_weights(outer)
