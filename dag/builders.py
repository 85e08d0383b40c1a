"""Builders of job graphs: inference, generation, fine-tuning, data-parallel training.

`stages` lists each provider stage's block range `(first, last + 1)`; together they must cover
the model's blocks once, in order. Sizes come from the model's `ModelSpec`; FLOPs and memory
traffic per task feed the cost model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import networkx as nx

from dag.model import ModelSpec
from dag.tasks import Task, TaskKind, add_task, connect

Stages = Sequence[tuple[int, int]]
BACKWARD_FLOPS = 2.0  # backward costs about twice the forward (activation + weight grads)


def check_stages(model: ModelSpec, stages: Stages) -> None:
    expected = 0
    for first, end in stages:
        if first != expected or end <= first:
            raise ValueError(
                f"stages {list(stages)} must cover blocks 0..{model.n_layers - 1} contiguously, "
                f"each with at least one block"
            )
        expected = end
    if expected != model.n_layers:
        raise ValueError(f"stages {list(stages)} cover {expected} of {model.n_layers} blocks")


def _forward(
    model: ModelSpec,
    stage: int,
    span: tuple[int, int],
    tid: str,
    tokens: int,
    context: int,
    sequences: int,
    replica: int,
    extra_inputs: dict[str, float] | None = None,
    extra_outputs: dict[str, float] | None = None,
) -> Task:
    n = span[1] - span[0]
    hidden_in = model.hidden_bytes_per_token * tokens
    return Task(
        id=tid,
        kind=TaskKind.FORWARD,
        stage=stage,
        replica=replica,
        flops=n
        * tokens
        * (model.layer_flops_per_token + model.layer_attn_flops_per_token_per_context * context),
        mem_bytes=n
        * (model.layer_param_bytes + sequences * context * model.layer_kv_bytes_per_token),
        inputs={"hidden": hidden_in, **(extra_inputs or {})},
        outputs={"hidden": hidden_in, **(extra_outputs or {})},
    )


def _chain_forward(
    graph: nx.DiGraph,
    model: ModelSpec,
    stages: Stages,
    prefix: str,
    source: Task,
    tokens: int,
    context: int,
    sequences: int,
    replica: int = 0,
) -> list[Task]:
    tasks = []
    previous = source
    for s, span in enumerate(stages):
        fwd = add_task(
            graph,
            _forward(model, s, span, f"{prefix}fwd.s{s}", tokens, context, sequences, replica),
        )
        connect(graph, previous, fwd, "hidden")
        tasks.append(fwd)
        previous = fwd
    return tasks


def inference_pipeline(model: ModelSpec, stages: Stages, *, batch: int, seq: int) -> nx.DiGraph:
    """One batch through every stage: load, embed, forward per stage, head."""
    check_stages(model, stages)
    g = nx.DiGraph(name=f"{model.name}/inference", kind="inference")
    tokens = batch * seq
    hidden = model.hidden_bytes_per_token * tokens
    load = add_task(g, Task("load", TaskKind.DATA_LOAD, outputs={"ids": 8.0 * tokens}))
    embed = add_task(
        g,
        Task(
            "embed",
            TaskKind.EMBED,
            mem_bytes=hidden,
            inputs={"ids": 8.0 * tokens},
            outputs={"hidden": hidden},
        ),
    )
    connect(g, load, embed, "ids")
    forwards = _chain_forward(g, model, stages, "", embed, tokens, seq, batch)
    head = add_task(
        g,
        Task(
            "head",
            TaskKind.HEAD,
            flops=tokens * model.head_flops_per_token,
            inputs={"hidden": hidden},
        ),
    )
    connect(g, forwards[-1], head, "hidden")
    return g


def generation(
    model: ModelSpec, stages: Stages, *, batch: int, prompt: int, new_tokens: int
) -> nx.DiGraph:
    """Prefill of the prompt, then `new_tokens` decode steps, each sending one token's hidden
    state per sequence; each stage's KV cache flows from one step to the next on its provider."""
    check_stages(model, stages)
    g = nx.DiGraph(name=f"{model.name}/generation", kind="generation")
    previous_head: Task | None = None
    previous_fwd: list[Task] = []
    for step in range(new_tokens + 1):
        seq = prompt if step == 0 else 1
        context = prompt + step
        tokens = batch * seq
        hidden = model.hidden_bytes_per_token * tokens
        name = "prefill" if step == 0 else f"decode{step}"
        embed = add_task(
            g,
            Task(
                f"{name}.embed",
                TaskKind.EMBED,
                mem_bytes=hidden,
                inputs={"ids": 8.0 * tokens} if previous_head else {},
                outputs={"hidden": hidden},
            ),
        )
        if previous_head is not None:
            connect(g, previous_head, embed, "ids")
        current = []
        source = embed
        for s, span in enumerate(stages):
            kv_in = (context - seq) * batch * model.layer_kv_bytes_per_token * (span[1] - span[0])
            kv_out = context * batch * model.layer_kv_bytes_per_token * (span[1] - span[0])
            fwd = add_task(
                g,
                _forward(
                    model,
                    s,
                    span,
                    f"{name}.fwd.s{s}",
                    tokens,
                    context,
                    batch,
                    0,
                    extra_inputs={"kv": kv_in} if previous_fwd else None,
                    extra_outputs={"kv": kv_out},
                ),
            )
            connect(g, source, fwd, "hidden")
            if previous_fwd:
                connect(g, previous_fwd[s], fwd, "kv")
            current.append(fwd)
            source = fwd
        head = add_task(
            g,
            Task(
                f"{name}.head",
                TaskKind.HEAD,
                flops=batch * model.head_flops_per_token,
                inputs={"hidden": hidden},
                outputs={"ids": 8.0 * batch} if step < new_tokens else {},
            ),
        )
        connect(g, source, head, "hidden")
        previous_head, previous_fwd = head, current
    return g


def _finetune_replica(
    g: nx.DiGraph,
    model: ModelSpec,
    stages: Stages,
    *,
    microbatches: int,
    batch: int,
    seq: int,
    adapter_bytes: Sequence[float],
    replica: int,
    prefix: str,
) -> list[list[Task]]:
    """Forward/backward of every microbatch; returns backward tasks per stage."""
    tokens = batch * seq
    hidden = model.hidden_bytes_per_token * tokens
    backward_by_stage: list[list[Task]] = [[] for _ in stages]
    for m in range(microbatches):
        p = f"{prefix}mb{m}."
        load = add_task(
            g,
            Task(
                f"{p}load",
                TaskKind.DATA_LOAD,
                replica=replica,
                outputs={"ids": 8.0 * tokens},
                microbatch=m,
            ),
        )
        embed = add_task(
            g,
            Task(
                f"{p}embed",
                TaskKind.EMBED,
                replica=replica,
                mem_bytes=hidden,
                inputs={"ids": 8.0 * tokens},
                outputs={"hidden": hidden},
                microbatch=m,
            ),
        )
        connect(g, load, embed, "ids")
        forwards = []
        source = embed
        for s, span in enumerate(stages):
            saved = hidden * (span[1] - span[0])  # LoRA-FA keeps block inputs, not A's inputs
            fwd = add_task(
                g,
                replace(
                    _forward(
                        model,
                        s,
                        span,
                        f"{p}fwd.s{s}",
                        tokens,
                        seq,
                        batch,
                        replica,
                        extra_outputs={"saved": saved},
                    ),
                    microbatch=m,
                ),
            )
            connect(g, source, fwd, "hidden")
            forwards.append(fwd)
            source = fwd
        loss = add_task(
            g,
            Task(
                f"{p}loss",
                TaskKind.LOSS,
                replica=replica,
                flops=3 * tokens * model.head_flops_per_token,
                inputs={"hidden": hidden},
                outputs={"grad": hidden},
                microbatch=m,
            ),
        )
        connect(g, source, loss, "hidden")
        upstream = loss
        for s in reversed(range(len(stages))):
            fwd = forwards[s]
            bwd = add_task(
                g,
                Task(
                    f"{p}bwd.s{s}",
                    TaskKind.BACKWARD,
                    stage=s,
                    replica=replica,
                    flops=BACKWARD_FLOPS * fwd.flops,
                    mem_bytes=fwd.mem_bytes,
                    inputs={"grad": hidden, "saved": fwd.outputs["saved"]},
                    outputs={"grad": hidden, "adapter_grad": adapter_bytes[s]},
                    microbatch=m,
                ),
            )
            connect(g, upstream, bwd, "grad")
            connect(g, fwd, bwd, "saved")
            backward_by_stage[s].append(bwd)
            upstream = bwd
    return backward_by_stage


def finetune(
    model: ModelSpec,
    stages: Stages,
    *,
    microbatches: int,
    batch: int,
    seq: int,
    adapter_bytes: Sequence[float] | None = None,
) -> nx.DiGraph:
    """One optimizer step: microbatches forward and backward through the pipeline, then each
    stage updates its trainable adapters once gradients of every microbatch are in."""
    check_stages(model, stages)
    adapter = list(adapter_bytes) if adapter_bytes is not None else [0.0] * len(stages)
    g = nx.DiGraph(name=f"{model.name}/finetune", kind="finetune")
    backward = _finetune_replica(
        g,
        model,
        stages,
        microbatches=microbatches,
        batch=batch,
        seq=seq,
        adapter_bytes=adapter,
        replica=0,
        prefix="",
    )
    for s, tasks in enumerate(backward):
        update = add_task(
            g,
            Task(
                f"update.s{s}",
                TaskKind.UPDATE,
                stage=s,
                mem_bytes=4 * adapter[s],
                inputs={f"adapter_grad.mb{m}": adapter[s] for m in range(len(tasks))},
            ),
        )
        for m, bwd in enumerate(tasks):
            connect(g, bwd, update, "adapter_grad", into=f"adapter_grad.mb{m}")
    return g


def data_parallel_train(
    model: ModelSpec,
    stages: Stages,
    *,
    replicas: int,
    microbatches: int,
    batch: int,
    seq: int,
    adapter_bytes: Sequence[float] | None = None,
) -> nx.DiGraph:
    """`replicas` pipelines on different data; per stage, an all-reduce averages the trainable
    gradients of every replica before each replica's update."""
    check_stages(model, stages)
    if replicas < 1:
        raise ValueError("data-parallel training needs at least one replica")
    adapter = list(adapter_bytes) if adapter_bytes is not None else [0.0] * len(stages)
    g = nx.DiGraph(name=f"{model.name}/data-parallel", kind="data_parallel_train")
    per_replica = [
        _finetune_replica(
            g,
            model,
            stages,
            microbatches=microbatches,
            batch=batch,
            seq=seq,
            adapter_bytes=adapter,
            replica=r,
            prefix=f"r{r}.",
        )
        for r in range(replicas)
    ]
    for s in range(len(stages)):
        inputs = {
            f"adapter_grad.r{r}.mb{m}": adapter[s]
            for r in range(replicas)
            for m in range(microbatches)
        }
        reduce = add_task(
            g,
            Task(
                f"allreduce.s{s}",
                TaskKind.ALLREDUCE,
                stage=s,
                flops=replicas * microbatches * adapter[s] / 2,
                inputs=inputs,
                outputs={"mean_grad": adapter[s]},
            ),
        )
        for r in range(replicas):
            for m, bwd in enumerate(per_replica[r][s]):
                connect(g, bwd, reduce, "adapter_grad", into=f"adapter_grad.r{r}.mb{m}")
            update = add_task(
                g,
                Task(
                    f"r{r}.update.s{s}",
                    TaskKind.UPDATE,
                    stage=s,
                    replica=r,
                    mem_bytes=4 * adapter[s],
                    inputs={"mean_grad": adapter[s]},
                ),
            )
            connect(g, reduce, update, "mean_grad")
    return g
