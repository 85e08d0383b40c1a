"""Client SDK (async and sync): embeddings, generation sessions over p2p, batch jobs.

    from client import Client
    with Client("http://127.0.0.1:7371", api_key="...") as fa:
        print(fa.embed(["hello"]).shape)

Sessions run the tokenizer, embedding and output head locally and send hidden states along the
providers' route; embeddings and batch jobs go through the broker. Wire and IR code come from
`p2p`, `proto` and `ir`, never reimplemented here.
"""

from client.api import AsyncClient
from client.errors import (
    APIError,
    AuthenticationError,
    BadRequestError,
    BrokerUnreachable,
    ConflictError,
    FusionAIError,
    GenerationError,
    JobFailed,
    JobTimeout,
    NotFoundError,
    RateLimitError,
    ServerError,
    UnavailableError,
    VerificationError,
)
from client.sync import Client
from client.training import Trained
from client.types import Failover, FineTune, FinetuneStep, Generation, GenerationStream, Job

__all__ = [
    "APIError",
    "AsyncClient",
    "AuthenticationError",
    "BadRequestError",
    "BrokerUnreachable",
    "Client",
    "ConflictError",
    "Failover",
    "FineTune",
    "FinetuneStep",
    "FusionAIError",
    "Generation",
    "GenerationError",
    "GenerationStream",
    "Job",
    "JobFailed",
    "JobTimeout",
    "NotFoundError",
    "RateLimitError",
    "ServerError",
    "Trained",
    "UnavailableError",
    "VerificationError",
]
