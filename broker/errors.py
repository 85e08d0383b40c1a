"""Errors the broker's API reports to clients (the HTTP layer maps each to a status)."""

from __future__ import annotations


class NotFound(Exception):
    """An unknown model, job or artifact (404)."""


class Conflict(Exception):
    """Not possible in the current state; the message says when it will be (409)."""


class Unavailable(Exception):
    """The swarm cannot serve this now (no provider serves a stage in time): 503."""


class TooBusy(Exception):
    """Too many requests in progress: 429, try again shortly."""
