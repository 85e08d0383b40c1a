"""The SDK's exceptions: one base class, one subclass per kind of failure a caller handles."""

from __future__ import annotations

from typing import Any


class FusionAIError(Exception):
    """Base class of every error the SDK raises."""


class BrokerUnreachable(FusionAIError):
    """The broker did not answer at all (refused, unreachable, TLS failure, timed out), also
    after the SDK tried again for its `retry_s`. `sent` is False when the request surely did
    not reach it; True when it may have (the connection broke after it was sent): a job
    submission may then have been queued."""

    def __init__(self, message: str, *, sent: bool = True) -> None:
        super().__init__(message)
        self.sent = sent


class APIError(FusionAIError):
    """The broker answered with an error; `status` is the HTTP status, `field` the offending
    request field when it names one."""

    def __init__(self, status: int, message: str, field: str | None = None) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.field = field


class BadRequestError(APIError):
    """400 or 413: the request is invalid or too large (see `field`)."""


class AuthenticationError(APIError):
    """401 or 403: no valid API key."""


class NotFoundError(APIError):
    """404: no such model, job or artifact."""


class ConflictError(APIError):
    """409: not possible yet (for example, results of a job still running)."""


class RateLimitError(APIError):
    """429: too many requests in progress; try again after `retry_after` seconds."""

    def __init__(self, status: int, message: str, retry_after: float | None = None) -> None:
        super().__init__(status, message)
        self.retry_after = retry_after


class UnavailableError(APIError):
    """503: no provider serves the model within the deadline."""


class ServerError(APIError):
    """Any other 5xx: the broker failed (its log has the details)."""


class GenerationError(FusionAIError):
    """A generation step could not be completed on any provider; the message says why."""


class VerificationError(GenerationError):
    """Two providers' answers to a step disagree and the broker found neither wrong: the
    output cannot be trusted."""


class JobFailed(FusionAIError):
    """A batch job ended without succeeding (failed or cancelled); `job` is its last state."""

    def __init__(self, job: Any) -> None:
        super().__init__(f"job {job.id} {job.state}" + (f": {job.error}" if job.error else ""))
        self.job = job


class JobTimeout(FusionAIError, TimeoutError):
    """`wait` gave up before the job ended; the job goes on."""


def for_status(
    status: int, message: str, field: str | None = None, retry_after: float | None = None
) -> APIError:
    """The exception for an HTTP error status."""
    if status == 429:
        return RateLimitError(status, message, retry_after)
    kind: type[APIError] = {
        400: BadRequestError,
        413: BadRequestError,
        401: AuthenticationError,
        403: AuthenticationError,
        404: NotFoundError,
        409: ConflictError,
        503: UnavailableError,
    }.get(status, ServerError if status >= 500 else APIError)
    return kind(status, message, field)
