"""Workloads: what the swarm runs, in terms the cost model and placement understand.

Inference prefills a batch of prompts in one pass through the pipeline (compute-bound), then
decodes them together (one token per sequence per step, memory-bound). Fine-tuning with
LoRA-FA runs forward and backward through the frozen blocks (backward costs about twice the
forward; gradients flow back as large as the activations flowed forward), with small adapter
gradients averaged across replicas per step. Pre-training also keeps gradients and Adam
states for every weight (16 bytes per parameter in mixed precision instead of 2) and
all-reduces every gradient across replicas each step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dag.cost import Workload
from dag.model import LLAMA2_7B, LLAMA2_13B, LLAMA2_70B, ModelSpec

MODELS = {"llama2-7b": LLAMA2_7B, "llama2-13b": LLAMA2_13B, "llama2-70b": LLAMA2_70B}
KINDS = ("inference", "finetune", "pretrain")


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    kind: str  # "inference", "finetune" or "pretrain"
    model: ModelSpec  # the model as served (fp16 weights)
    work: Workload  # per microbatch
    microbatches: int = 1  # per job (one optimizer step for training)
    adapter_fraction: float = 0.002  # trainable share of a block's weights (LoRA-FA's B)
    prompt_tokens: int = 0  # inference: prompt length per sequence, prefilled before decoding

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
            scaled = replace(scaled, layer_param_bytes=8 * m.layer_param_bytes)  # 16 B/param
        return scaled

    @property
    def job_tokens(self) -> int:
        return self.work.tokens * self.microbatches

    def allreduce_bytes_per_block(self) -> float:
        """Gradient bytes each block exchanges per step across replicas."""
        if self.kind == "inference":
            return 0.0
        share = 1.0 if self.kind == "pretrain" else self.adapter_fraction
        return self.model.layer_param_bytes * share


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
