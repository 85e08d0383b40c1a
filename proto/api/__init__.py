"""The broker's HTTP API as typed bodies: every request and response body of `/v1`, with its
field limits, as frozen msgspec structs. The broker decodes requests into them and answers
with them; its OpenAPI document is generated from them (`broker/openapi.py`); the SDK decodes
answers into them (`client/`). Data only, like the rest of `proto/`.

    common  errors, health, events, artifacts
    swarm   providers, models and their routes, a session's pick and report
    jobs    batch job submissions (one struct per kind), jobs, results
    openai  OpenAI's embeddings, completions and chat completions shapes
"""

from proto.api.common import (
    ArtifactQuery,
    BrokerInfo,
    Error,
    ErrorDetail,
    Event,
    EventList,
    EventsQuery,
    Health,
    Stored,
    StreamQuery,
)
from proto.api.jobs import (
    Adapter,
    Deleted,
    EmbedJobRequest,
    EmbedResults,
    FinetuneJobRequest,
    FinetuneResults,
    Job,
    JobList,
    JobQuery,
    JobRequest,
    JobsQuery,
    Results,
    ResultsQuery,
    Step,
    Story,
    TrainJobRequest,
    TrainResults,
    TrainStep,
)
from proto.api.swarm import (
    Model,
    ModelCard,
    ModelList,
    Peer,
    Picked,
    PickRequest,
    Provider,
    ProviderList,
    Quarantined,
    Report,
    ReportRequest,
    Reputation,
    StageRoute,
    Swarm,
)

__all__ = [
    "Adapter", "ArtifactQuery", "BrokerInfo", "Deleted", "EmbedJobRequest", "EmbedResults",
    "Error", "ErrorDetail", "Event", "EventList", "EventsQuery", "FinetuneJobRequest",
    "FinetuneResults", "Health", "Job", "JobList", "JobQuery", "JobRequest", "JobsQuery",
    "Model", "ModelCard", "ModelList", "Peer", "PickRequest", "Picked", "Provider",
    "ProviderList", "Quarantined", "Report", "ReportRequest", "Reputation", "Results",
    "ResultsQuery", "StageRoute", "Step", "Stored", "Story", "StreamQuery", "Swarm",
    "TrainJobRequest", "TrainResults", "TrainStep",
]  # fmt: skip
