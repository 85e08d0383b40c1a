"""How fast a pipeline replica serves a workload: tokens/s, seconds per token, time to first
token (inference), or a training step with its all-reduce, from `dag.cost` on the machines'
profiles."""

from __future__ import annotations

from collections.abc import Mapping

from broker.core.placement import Replica
from dag.builders import finetune
from dag.cost import HardwareProfile, pipeline_metrics, schedule_length
from sim.workloads import WorkloadSpec


class ReplicaRates:
    def __init__(self, workload: WorkloadSpec, profiles: Mapping[str, HardwareProfile]) -> None:
        self.w = workload
        self.model = workload.placed_model
        self.profiles = profiles
        self._step_cache: dict[tuple[tuple[str, int, int], ...], float] = {}

    def metrics(self, replica: Replica, replicas: int) -> tuple[float, float, float]:
        """(tokens/s, seconds per token, seconds to the first token) of a replica, one of
        `replicas`: for inference, jobs' prefill passes and decode steps share the stages; for
        training, the optimizer step with its allreduce over the replicas (no first token)."""
        stages = [(self.profiles[st.provider], st.layers) for st in replica.stages]
        m = pipeline_metrics(self.model, stages, self.w.work, star=self.w.star)
        if self.w.kind == "inference":
            # Jobs in flight keep the pipeline full: each stage's busy time per job is its
            # share of the prefill pass plus its decode steps, and the busiest stage sets the
            # rate. The first token waits for the prefill's trip through every stage.
            prefill = pipeline_metrics(self.model, stages, self.w.prefill_work, star=self.w.star)
            busy = max(
                p + self.w.microbatches * d
                for p, d in zip(prefill.stage_times, m.stage_times, strict=True)
            )
            rate = self.w.job_tokens / busy if busy > 0 else 0.0
            return rate, m.latency, prefill.latency + m.latency
        step = self.step_seconds(replica)
        if replicas > 1:
            dtype = self.w.work.dtype
            step += max(  # compressing the gradients (low-rank compressors only)
                st.layers
                * self.w.compress_flops_per_block()
                / self.profiles[st.provider].flops_for(dtype)
                for st in replica.stages
            )
            share = 2 * (replicas - 1) / replicas
            step += max(
                share
                * st.layers
                * self.w.allreduce_bytes_per_block()
                / self.profiles[st.provider].net_bandwidth
                for st in replica.stages
            )
        # progress in synchronous training's tokens (the variant's stated token cost)
        return self.w.job_tokens / step / self.w.token_cost, m.latency, 0.0

    def step_seconds(self, replica: Replica) -> float:
        """One optimizer step of this replica: `dag.builders.finetune`'s graph (forward and
        backward of every microbatch, then the update) scheduled on its machines with
        `dag.cost.schedule_length`. Memoised per layout: repairs change one replica."""
        key = tuple((st.provider, st.first, st.end) for st in replica.stages)
        cached = self._step_cache.get(key)
        if cached is not None:
            return cached
        spans = [(st.first, st.end) for st in replica.stages]
        seq = self.w.work.tokens // self.w.work.sequences
        adapter = [self.w.trained_bytes_per_block() * (e - f) for f, e in spans]
        graph = finetune(
            self.w.model,
            spans,
            microbatches=self.w.microbatches,
            batch=self.w.work.sequences,
            seq=seq,
            adapter_bytes=adapter,
        )
        machines = {i: st.provider for i, st in enumerate(replica.stages)}
        step = schedule_length(
            graph,
            lambda t: machines[t.stage] if t.stage is not None else None,
            self.profiles,
            self.w.work.dtype,
        )
        self._step_cache[key] = step
        return step
