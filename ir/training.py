"""Fine-tuning one pipeline stage with LoRA-FA (or plain LoRA), and the loss at the head.

A stage's ONNX graph takes each adapted linear layer's A and B as inputs (`y = W x +
(x A^T) B^T`), so training needs no change to the validated graph: the torch executor runs it
with autograd and gradients reach the adapter tensors. LoRA-FA (arXiv:2308.03303) freezes the
down-projection A at its random initialisation and trains only B: backward then keeps
`x A^T` (rank r) instead of `x` (the hidden size) for each adapted layer, which cuts
activation memory. Plain LoRA trains both and is the baseline.

`StageTrainer` is what a provider runs (and what the single-process reference runs): forward
of a microbatch keeps its autograd graph until the backward of the same microbatch arrives,
gradients accumulate, and `update` takes one AdamW step once every microbatch of the step is
in. Its whole state (adapters, optimizer moments, step) is a flat dict of numpy arrays,
serialised as safetensors: that is what snapshots carry and what a finished adapter is.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ir.errors import ExecutorError
from ir.manifest import StageInfo
from ir.pipeline import KEY_MASK, batchable

Array = np.ndarray[Any, Any]
METHODS = ("lora-fa", "lora")
MAX_PENDING = 256  # microbatches whose forward awaits its backward, per stage
STEP_KEY = "optimizer.step"


class TrainingError(ExecutorError):
    """A training request does not fit the trainer's state; the message says why."""


def init_adapters(stage: StageInfo, rank: int, seed: int) -> dict[str, Array]:
    """A (rank, in) uniform in +-1/sqrt(in) (what LoRA's kaiming init gives), B zero: the stage
    starts equal to its base model. Deterministic in (seed, stage index) on every platform."""
    if not stage.adapters:
        raise TrainingError(f"stage {stage.name} has no adapter slots; export it with adapters")
    rng = np.random.default_rng([seed, stage.index])
    out: dict[str, Array] = {}
    for a in stage.adapters:
        bound = 1.0 / math.sqrt(a.in_features)
        out[a.a_input] = rng.uniform(-bound, bound, (rank, a.in_features)).astype(np.float32)
        out[a.b_input] = np.zeros((a.out_features, rank), dtype=np.float32)
    return out


def check_adapters(stage: StageInfo, tensors: Mapping[str, Array]) -> int:
    """Adapter tensors for `stage`: every slot's A and B, float32, shapes that fit, one rank.
    Returns the rank; raises `TrainingError` naming what is wrong."""
    expected = {n for a in stage.adapters for n in (a.a_input, a.b_input)}
    names = set(tensors)
    if names != expected:
        missing, extra = sorted(expected - names), sorted(names - expected)
        raise TrainingError(
            f"stage {stage.name}: adapter tensors do not match its slots "
            f"(missing {missing[:4]}, unexpected {extra[:4]})"
        )
    ranks = set()
    for a in stage.adapters:
        A, B = tensors[a.a_input], tensors[a.b_input]
        if A.dtype != np.float32 or B.dtype != np.float32:
            raise TrainingError(f"{a.target}: adapters are float32")
        if A.ndim != 2 or B.ndim != 2 or A.shape[1] != a.in_features:
            raise TrainingError(f"{a.a_input}: shape {A.shape}, expected (rank, {a.in_features})")
        if B.shape[0] != a.out_features or B.shape[1] != A.shape[0]:
            raise TrainingError(
                f"{a.b_input}: shape {B.shape}, expected ({a.out_features}, {A.shape[0]})"
            )
        if not (np.isfinite(A).all() and np.isfinite(B).all()):
            raise TrainingError(f"{a.target}: adapters must be finite")
        ranks.add(A.shape[0])
    if len(ranks) != 1 or not 1 <= next(iter(ranks)) <= 1024:
        raise TrainingError(f"stage {stage.name}: one rank from 1 to 1024 for all slots")
    return ranks.pop()


def pack(sequences: Sequence[Sequence[int]], seq_len: int) -> Array:
    """Token sequences joined end to end and cut into (blocks, seq_len + 1) rows: a row's first
    seq_len tokens are the input, its last seq_len the targets. No padding is trained on."""
    flat = np.fromiter((t for s in sequences for t in s), dtype=np.int64)
    width = seq_len + 1
    n = len(flat) // width
    if n == 0:
        raise TrainingError(
            f"the data has {len(flat)} tokens; one sequence of seq_len {seq_len} needs {width}"
        )
    return flat[: n * width].reshape(n, width)


def step_rows(blocks: int, step: int, batch: int, seed: int) -> Array:
    """Which rows step `step` trains on: a function of (seed, step) alone, so a step replayed
    after a recovery sees the same data."""
    rng = np.random.default_rng([seed, step])
    return rng.choice(blocks, size=batch, replace=blocks < batch)


class StageTrainer:
    """One stage's adapters and AdamW state, run with autograd on an ONNX stage module."""

    def __init__(
        self,
        module: Any,  # ir.executors.torch_exec.OnnxModule of the stage
        stage: StageInfo,
        adapters: Mapping[str, Array],
        *,
        method: str = "lora-fa",
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        microbatches: int = 1,
    ) -> None:
        import torch

        if method not in METHODS:
            raise TrainingError(f"unknown method {method!r}; use one of {list(METHODS)}")
        self.rank = check_adapters(stage, adapters)
        self.module, self.stage, self.method = module, stage, method
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.microbatches = microbatches
        self.params: dict[str, Any] = {}
        for a in stage.adapters:
            for name in (a.a_input, a.b_input):
                trainable = name == a.b_input or method == "lora"
                self.params[name] = torch.tensor(adapters[name]).requires_grad_(trainable)
        self.trainable = [n for n, p in self.params.items() if p.requires_grad]
        self.m = {n: torch.zeros_like(self.params[n]) for n in self.trainable}
        self.v = {n: torch.zeros_like(self.params[n]) for n in self.trainable}
        self.grad: dict[str, Any] = {}
        self.step = 0  # optimizer steps taken
        self.received: set[int] = set()  # microbatches of step + 1 whose gradients are in
        self.pending: dict[tuple[int, int], tuple[Any, Any]] = {}
        self.last_norm = 0.0
        self.lock = threading.Lock()

    @property
    def trainable_parameters(self) -> int:
        return sum(int(self.params[n].numel()) for n in self.trainable)

    def _feeds(self, inputs: Mapping[str, Array], hidden: Any) -> dict[str, Any]:
        import torch

        batch = int(hidden.shape[0])
        feeds: dict[str, Any] = {}
        for info in self.stage.inputs:
            name = info.name
            if name == "hidden_states":
                feeds[name] = hidden
            elif name in self.params:
                feeds[name] = self.params[name]
            elif name.startswith("past_"):  # training sees whole sequences: an empty cache
                shape = [
                    batch if d == "batch" else (0 if isinstance(d, str) else d) for d in info.shape
                ]
                feeds[name] = torch.zeros(shape, dtype=getattr(torch, info.dtype))
            elif name == KEY_MASK and batchable(self.stage):  # no padding, no cache
                feeds[name] = torch.ones((batch, int(hidden.shape[1])), dtype=torch.int64)
            elif name in inputs:
                feeds[name] = torch.from_numpy(np.ascontiguousarray(inputs[name]))
            else:
                raise TrainingError(f"stage {self.stage.name} needs input {name!r}")
        return feeds

    def forward(self, step: int, microbatch: int, inputs: Mapping[str, Array]) -> Array:
        """Run a microbatch of step `step` and keep its graph for `backward`."""
        import torch

        if step != self.step + 1:
            raise TrainingError(f"forward of step {step}, but this stage is at step {self.step}")
        hidden_np = inputs.get("hidden_states")
        if hidden_np is None or hidden_np.dtype != np.float32 or hidden_np.ndim != 3:
            raise TrainingError("hidden_states must be float32 (batch, sequence, hidden)")
        with self.lock:
            if len(self.pending) >= MAX_PENDING and (step, microbatch) not in self.pending:
                raise TrainingError(f"more than {MAX_PENDING} microbatches await backward")
        hidden = torch.from_numpy(np.ascontiguousarray(hidden_np)).requires_grad_(True)
        with torch.enable_grad():
            out = self.module(**self._feeds(inputs, hidden))["hidden_states_out"]
        with self.lock:
            self.pending[(step, microbatch)] = (hidden, out)
        result: Array = out.detach().numpy().copy()
        return result

    def backward(self, step: int, microbatch: int, grad: Array, input_grad: bool) -> Array | None:
        """Backward of a microbatch: accumulate the adapters' gradients; return the gradient
        for the stage's input hidden states if `input_grad`."""
        import torch

        with self.lock:
            entry = self.pending.pop((step, microbatch), None)
        if entry is None:
            raise TrainingError(f"no forward of step {step} microbatch {microbatch} is kept here")
        hidden, out = entry
        if grad.shape != tuple(out.shape) or grad.dtype != np.float32:
            raise TrainingError(f"gradient shape {grad.shape}, expected {tuple(out.shape)}")
        targets = [self.params[n] for n in self.trainable] + ([hidden] if input_grad else [])
        grads = torch.autograd.grad(out, targets, grad_outputs=torch.from_numpy(grad))
        with self.lock:
            for name, g in zip(self.trainable, grads, strict=False):
                self.grad[name] = g if name not in self.grad else self.grad[name] + g
            self.received.add(microbatch)
        if not input_grad:
            return None
        result: Array = grads[-1].numpy().copy()
        return result

    def update(self, step: int) -> float:
        """One AdamW step once every microbatch's gradient of `step` is in; returns the
        gradient norm. Repeating the last step's update is answered, not applied twice."""
        import torch

        with self.lock:
            if step == self.step and step > 0:
                return self.last_norm
            if step != self.step + 1:
                raise TrainingError(f"update of step {step}, but this stage is at step {self.step}")
            missing = sorted(set(range(self.microbatches)) - self.received)
            if missing:
                raise TrainingError(f"step {step}: gradients of microbatches {missing} are missing")
            b1, b2 = self.betas
            t = step
            norm = 0.0
            with torch.no_grad():
                for name in self.trainable:
                    p, g = self.params[name], self.grad[name]
                    norm += float((g * g).sum())
                    if self.weight_decay:
                        p.mul_(1 - self.lr * self.weight_decay)
                    self.m[name].mul_(b1).add_(g, alpha=1 - b1)
                    self.v[name].mul_(b2).addcmul_(g, g, value=1 - b2)
                    m_hat = self.m[name] / (1 - b1**t)
                    v_hat = self.v[name] / (1 - b2**t)
                    p.sub_(self.lr * m_hat / (v_hat.sqrt() + self.eps))
            self.grad.clear()
            self.received.clear()
            self.pending = {k: v for k, v in self.pending.items() if k[0] > step}
            self.step = step
            self.last_norm = math.sqrt(norm)
            return self.last_norm

    def adapters(self) -> dict[str, Array]:
        with self.lock:
            return {n: p.detach().numpy().copy() for n, p in self.params.items()}

    def state(self) -> dict[str, Array]:
        """Adapters, optimizer moments and step: everything needed to go on from here."""
        with self.lock:
            out = {n: p.detach().numpy().copy() for n, p in self.params.items()}
            for n in self.trainable:
                out[f"adam_m.{n}"] = self.m[n].numpy().copy()
                out[f"adam_v.{n}"] = self.v[n].numpy().copy()
            out[STEP_KEY] = np.array([self.step], dtype=np.int64)
            return out

    def load_state(self, state: Mapping[str, Array]) -> None:
        import torch

        adapters = {n: state[n] for n in self.params if n in state}
        check_adapters(self.stage, adapters)
        for n in self.trainable:
            for key in (f"adam_m.{n}", f"adam_v.{n}"):
                if key not in state or state[key].shape != adapters[n].shape:
                    raise TrainingError(f"the state has no valid {key}")
        if STEP_KEY not in state:
            raise TrainingError("the state has no optimizer step")
        with self.lock:
            for n in self.params:
                self.params[n] = torch.tensor(adapters[n]).requires_grad_(n in self.trainable)
            self.m = {n: torch.tensor(state[f"adam_m.{n}"]) for n in self.trainable}
            self.v = {n: torch.tensor(state[f"adam_v.{n}"]) for n in self.trainable}
            self.step = int(state[STEP_KEY][0])
            self.grad.clear()
            self.received.clear()
            self.pending.clear()


def saved_bytes(trainer: StageTrainer, step: int, mb: int, inputs: Mapping[str, Array]) -> int:
    """Bytes a forward keeps for backward (counted with saved_tensors_hooks): activations only
    (the stage's weights and adapters are left out), each storage counted once."""
    import torch

    weights = {t.untyped_storage().data_ptr() for t in trainer.module.buffers()}
    weights |= {p.untyped_storage().data_ptr() for p in trainer.params.values()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights:
            seen[ptr] = max(seen.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trainer.forward(step, mb, inputs)
    return sum(seen.values())


class HeadLoss:
    """The client-side head (final norm + LM head, frozen) and next-token cross-entropy: the
    loss of a microbatch and its gradient with respect to the hidden states."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def __call__(self, hidden: Array, targets: Array, scale: float) -> tuple[float, Array]:
        """`scale` times the summed token losses (scale = 1 / tokens of the step makes the
        microbatches' values add up to the step's mean loss), and its gradient."""
        import torch

        h = torch.from_numpy(np.ascontiguousarray(hidden, dtype=np.float32)).requires_grad_(True)
        with torch.enable_grad():
            logits = self.module(hidden_states=h)["logits"].float()
            loss = (
                torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]),
                    torch.from_numpy(np.ascontiguousarray(targets)).reshape(-1),
                    reduction="sum",
                )
                * scale
            )
            (grad,) = torch.autograd.grad(loss, [h])
        return float(loss.detach()), grad.numpy().copy()


def save_state(tensors: Mapping[str, Array], metadata: Mapping[str, str] | None = None) -> bytes:
    """safetensors bytes of a flat dict of arrays (no pickle)."""
    from safetensors.numpy import save

    return bytes(
        save({k: np.ascontiguousarray(v) for k, v in tensors.items()}, dict(metadata or {}))
    )


def load_state(data: bytes) -> dict[str, Array]:
    from safetensors import SafetensorError
    from safetensors.numpy import load

    try:
        return dict(load(data))
    except (SafetensorError, ValueError) as exc:
        raise TrainingError(f"not a safetensors file: {exc}") from None


def read_metadata(data: bytes) -> dict[str, str]:
    """The `__metadata__` of safetensors bytes."""
    import json
    import struct

    if len(data) < 8:
        raise TrainingError("not a safetensors file: too short")
    (size,) = struct.unpack("<Q", data[:8])
    if size > min(len(data) - 8, 100_000_000):
        raise TrainingError("not a safetensors file: bad header size")
    try:
        header = json.loads(data[8 : 8 + size])
    except ValueError as exc:
        raise TrainingError(f"not a safetensors file: {exc}") from None
    meta = header.get("__metadata__", {}) if isinstance(header, dict) else {}
    return {str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else {}
