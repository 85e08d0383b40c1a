"""Errors the broker's API reports to clients (the HTTP layer maps each to a status)."""

from __future__ import annotations


class NotFound(Exception):
    """An unknown model, job or artifact (404)."""


class Conflict(Exception):
    """Not possible in the current state; the message says when it will be (409)."""


class Unavailable(Exception):
    """The swarm cannot serve this now (no provider serves a stage in time): 503."""


class TooBusy(Exception):
    """Too many requests in progress: 429, with `Retry-After` of `retry_after_s` (whole
    seconds, at least 1)."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
