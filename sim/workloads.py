"""Workloads: what the swarm runs, in terms the cost model and placement understand.

Inference prefills a batch of prompts in one pass through the pipeline (compute-bound), then
decodes them together (one token per sequence per step, memory-bound). Fine-tuning with
LoRA-FA runs forward and backward through the frozen blocks (backward costs about twice the
forward; gradients flow back as large as the activations flowed forward), with small adapter
gradients averaged across replicas per step. Pre-training also keeps gradients and Adam
states for every weight (16 bytes per parameter in mixed precision instead of 2) and
all-reduces every gradient across replicas each step, or less (`trained`): fp32 or fp16
gradients, Power-SGD's or ACP-SGD's low-rank factors, and DiLoCo's pseudo-gradient once every H
local steps.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dag.cost import Workload
from dag.model import LLAMA2_7B, LLAMA2_13B, LLAMA2_70B, ModelSpec

# bytes per weight as stored (fp16; int8/int4 in blocks of 32 with a float32 scale each, as
# `ir split --quantize` writes them) and per hidden-state value on the wire (int8: one float32
# scale per token on top)
WEIGHT_BYTES = {"fp16": 2.0, "int8": 1.0 + 4 / 32, "int4": 0.5 + 4 / 32}
WIRE_BYTES = {"fp16": 2.0, "int8": 1.0}
MODELS = {"llama2-7b": LLAMA2_7B, "llama2-13b": LLAMA2_13B, "llama2-70b": LLAMA2_70B}
KINDS = ("inference", "finetune", "pretrain")
# pre-training's gradient exchange: fp32 ("none"), fp16 (mixed precision's gradients, the
# default), Power-SGD (P and Q every step) and ACP-SGD (P or Q, alternately), as
# `ir.compress` runs them; the low-rank factors and the vectors travel as fp16 here
COMPRESSORS = ("none", "fp16", "powersgd", "acp")
GRADIENT_BYTES = 2.0


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    kind: str  # "inference", "finetune" or "pretrain"
    model: ModelSpec  # the model as served (fp16 weights)
    work: Workload  # per microbatch
    microbatches: int = 1  # per job (one optimizer step for training)
    adapter_fraction: float = 0.002  # trainable share of a block's weights (LoRA-FA's B)
    prompt_tokens: int = 0  # inference: prompt length per sequence, prefilled before decoding
    star: bool = False  # inference: the client sends each step to each stage and back
    compress: str = "fp16"  # pre-training: the gradient exchange (`COMPRESSORS`)
    rank: int = 4  # the low-rank compressors' rank
    outer_every: int = 1  # DiLoCo: local steps between exchanges (1: every step, no DiLoCo)
    # tokens this variant needs for the progress (loss) a synchronous token buys: an
    # assumption the scenario states (1.0: as good as synchronous training)
    token_cost: float = 1.0

    @property
    def prefill_work(self) -> Workload:
        """Inference: the whole prompt of every sequence in one pass (causal attention sees
        half the prompt on average)."""
        w = self.work
        return Workload(
            tokens=w.sequences * self.prompt_tokens,
            sequences=w.sequences,
            context=self.prompt_tokens // 2,
            dtype=w.dtype,
            kv_tokens=w.kv_tokens,
        )

    @property
    def placed_model(self) -> ModelSpec:
        """The model as placement sees it for this kind of work."""
        if self.kind == "inference":
            return self.model
        m = self.model
        scaled = replace(
            m,
            layer_flops_per_token=3 * m.layer_flops_per_token,
            layer_attn_flops_per_token_per_context=3 * m.layer_attn_flops_per_token_per_context,
            hidden_bytes_per_token=2 * m.hidden_bytes_per_token,  # activations on, gradients back
        )
        if self.kind == "pretrain":
            # 16 B/param; the low-rank compressors' error feedback adds a gradient's 2 B.
            # DiLoCo's outer copy and momentum live in host memory (as INTELLECT-1 kept them).
            per_weight = 8 + (1 if self.compress in LOW_RANK else 0)
            scaled = replace(scaled, layer_param_bytes=per_weight * m.layer_param_bytes)
        return scaled

    @property
    def job_tokens(self) -> int:
        return self.work.tokens * self.microbatches

    def trained_bytes_per_block(self) -> float:
        """Bytes (fp16) of the weights a training step updates in each block."""
        if self.kind == "inference":
            return 0.0
        share = 1.0 if self.kind == "pretrain" else self.adapter_fraction
        return self.model.layer_param_bytes * share

    def allreduce_bytes_per_block(self) -> float:
        """Gradient bytes each block exchanges per step across replicas (on average, for
        DiLoCo's exchange once every `outer_every` steps)."""
        if self.kind != "pretrain":
            return self.trained_bytes_per_block()
        m = self.model
        if self.compress in ("none", "fp16"):
            values = m.layer_param_bytes / 2  # the model's weights are fp16
            exchanged = values * (4.0 if self.compress == "none" else 2.0)
        else:
            low = float(sum((a + b) * min(self.rank, a, b) for a, b in self._matrices()))
            if self.compress == "acp":
                low /= 2  # P one step, Q the next
            exchanged = (low + m.layer_vector_values) * GRADIENT_BYTES
        return exchanged / self.outer_every

    def compress_flops_per_block(self) -> float:
        """Compute the gradient compressor adds to each block per step: Power-SGD multiplies
        each gradient matrix (m x n) by Q, by P and back (6mnr) and orthogonalises P (2mr^2);
        ACP-SGD computes one factor and the approximation (4mnr) and orthogonalises it."""
        if self.kind != "pretrain" or self.compress not in LOW_RANK:
            return 0.0
        total = 0.0
        for a, b in self._matrices():
            r = min(self.rank, a, b)
            if self.compress == "powersgd":
                total += 6 * a * b * r + 2 * a * r * r
            else:
                total += 4 * a * b * r + (a + b) * r * r / 2
        return total / self.outer_every

    def _matrices(self) -> tuple[tuple[int, int], ...]:
        if not self.model.layer_matrices:
            raise ValueError(f"{self.model.name}: no matrix shapes to compress")
        return self.model.layer_matrices


def quantized(spec: WorkloadSpec, weights: str = "fp16", wire: str = "fp16") -> WorkloadSpec:
    """`spec` with weight-only quantized weights and/or an int8 wire: the weights' bytes (held
    and read per step) and the hidden states' bytes per token change; the arithmetic stays
    fp16 (weights are de-quantized in the kernel) and so does the KV cache."""
    if weights not in WEIGHT_BYTES or wire not in WIRE_BYTES:
        raise ValueError(
            f"weights must be one of {sorted(WEIGHT_BYTES)} and wire one of {sorted(WIRE_BYTES)}"
        )
    if (weights, wire) == ("fp16", "fp16"):
        return spec
    if spec.kind != "inference":
        raise ValueError("quantized weights and the int8 wire model inference workloads only")
    m = spec.model
    values = m.hidden_bytes_per_token / WIRE_BYTES["fp16"]
    model = replace(
        m,
        layer_param_bytes=m.layer_param_bytes * WEIGHT_BYTES[weights] / WEIGHT_BYTES["fp16"],
        hidden_bytes_per_token=values * WIRE_BYTES[wire] + (4 if wire == "int8" else 0),
    )
    return replace(spec, model=model)


LOW_RANK = ("powersgd", "acp")


def trained(
    spec: WorkloadSpec,
    compress: str = "fp16",
    rank: int = 4,
    outer_every: int = 1,
    token_cost: float = 1.0,
) -> WorkloadSpec:
    """`spec` (pre-training) with its gradient exchange `compress`ed at `rank`, every
    `outer_every` local steps (DiLoCo when > 1), needing `token_cost` tokens for a
    synchronous token's progress."""
    if compress not in COMPRESSORS:
        raise ValueError(f"compress must be one of {COMPRESSORS}, got {compress!r}")
    if not 1 <= rank <= 1024 or not 1 <= outer_every <= 100_000:
        raise ValueError("rank is 1 to 1024 and outer_every 1 to 100000")
    if not 0.1 <= token_cost <= 100:
        raise ValueError("token_cost is 0.1 to 100")
    changed = (compress, rank, outer_every, token_cost) != ("fp16", 4, 1, 1.0)
    if spec.kind != "pretrain" and changed:
        raise ValueError("compress, rank, outer_every and token_cost model pre-training only")
    out = replace(
        spec, compress=compress, rank=rank, outer_every=outer_every, token_cost=token_cost
    )
    if compress in LOW_RANK:
        out._matrices()  # raises for a model without its shapes
    return out


STEPS = ("chained", "star")


def served(spec: WorkloadSpec, steps: str = "chained", batch: int | None = None) -> WorkloadSpec:
    """`spec` with its decode steps `chained` (client -> stage 1 -> ... -> client, n + 1 legs
    a step) or `star` (to each stage and back, 2n), and `batch` sequences decoded together in
    each step (a stage's step reads its weights once for the whole batch and each sequence's
    KV cache: the cost of a step as a function of the batch size)."""
    if steps not in STEPS:
        raise ValueError(f"steps must be one of {STEPS}, got {steps!r}")
    if spec.kind != "inference" and (steps != "chained" or batch is not None):
        raise ValueError("steps and batch model inference workloads only")
    if batch is not None and not 1 <= batch <= 4096:
        raise ValueError(f"batch must be 1 to 4096 sequences, got {batch}")
    work = spec.work
    if batch is not None and batch != work.sequences:
        per = work.kv_tokens // max(work.sequences, 1)  # KV room per sequence
        work = replace(work, tokens=batch, sequences=batch, kv_tokens=batch * per)
    return replace(spec, work=work, star=steps == "star")


def workload(name: str) -> WorkloadSpec:
    """`<model>-<kind>`, e.g. `llama2-13b-finetune`."""
    model_name, _, kind = name.rpartition("-")
    if model_name not in MODELS or kind not in KINDS:
        raise ValueError(
            f"unknown workload {name!r}; use <model>-<kind> with model in {sorted(MODELS)} and "
            f"kind in {list(KINDS)}"
        )
    model = MODELS[model_name]
    if kind == "inference":
        # 16 sequences of 1024-token prompts prefilled, then decoded together for 256 steps at
        # 1024 tokens of context; KV for 16 x 2048 tokens
        work = Workload(tokens=16, sequences=16, context=1024, kv_tokens=16 * 2048)
        return WorkloadSpec(name, kind, model, work, microbatches=256, prompt_tokens=1024)
    # 4 sequences x 512 tokens per microbatch, 8 microbatches per step
    work = Workload(tokens=4 * 512, sequences=4, context=512, kv_tokens=0)
    return WorkloadSpec(name, kind, model, work, microbatches=8)
