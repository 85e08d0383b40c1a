"""The SDK's HTTP calls to the broker: one request, its typed errors, and retries that carry a
call through a broker restart.

A try that cannot reach the broker (connection refused or reset, the connection closed before
the whole answer came) or that is answered 502, 503 or 504 (a proxy with no broker behind it,
a broker whose swarm cannot serve yet) is made again after a pause that doubles from
`Backoff.first_s` up to `Backoff.max_s`, plus a random jitter so that the clients of a
restarted broker do not all come back at the same moment, until the call's retry budget is
spent; the last failure is then raised, one typed error of `client.errors`. A try that timed
out is not made again (it used the call's whole deadline), nor one refused for good (TLS, an
unknown host name, any other 4xx or 5xx).

Whether a call may be made again depends on what a second copy of it would do (`Retry`):
- "any": reads, and writes whose repetition changes nothing (an artifact named by its hash,
  a cancel, embeddings): any transient failure is tried again;
- "unsent": a job submission: tried again only when the connection failed before the request
  left this process, so that a broker that received it and died before answering never
  queues the job twice (the caller is told that it may have been queued);
- "never": callers that handle failures themselves (generation's provider routing).
"""

from __future__ import annotations

import functools
import json
import logging
import ssl
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec

from client.errors import BrokerUnreachable, FusionAIError, for_status

log = logging.getLogger("fusionai.client")

Retry = Literal["any", "unsent", "never"]
RETRY_STATUS = frozenset({502, 503, 504})  # answers from a broker (or proxy) that may recover


@dataclass(frozen=True)
class Backoff:
    """The pauses between tries of one call."""

    first_s: float = 0.2  # seconds before the second try; doubled for each later one
    max_s: float = 5.0  # seconds: the longest pause between two tries
    jitter_s: float = 0.2  # seconds: up to this much random extra in each pause


class _Failed(Exception):
    """A try that failed in a way a later try may not: `error` is what the caller is given
    if no later try succeeds, `sent` whether the request may have reached the broker."""

    def __init__(self, error: FusionAIError, sent: bool) -> None:
        super().__init__(str(error))
        self.error = error
        self.sent = sent


def default_retry(method: str) -> Retry:
    """What may be tried again of a call by its method: a POST only when it was not sent."""
    return "unsent" if method.upper() == "POST" else "any"


class BrokerHttp:
    """An aiohttp session to one broker (made on first use, inside the caller's event loop)
    and the calls made through it; `close()` closes the session."""

    def __init__(
        self,
        url: str,
        api_key: str | None,
        cacert: str | None,
        retry_s: float,
        backoff: Backoff | None = None,
    ) -> None:
        """`retry_s`: the longest one call keeps trying, in seconds from its first try (0: a
        failed try is final)."""
        if retry_s < 0:
            raise ValueError("retry_s must be 0 or more seconds")
        self.url = url
        self.api_key = api_key
        self.cacert = cacert
        self.retry_s = retry_s
        self.backoff = backoff or Backoff()
        self._session: Any = None  # aiohttp.ClientSession

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def session(self) -> Any:
        if self._session is None:
            import aiohttp

            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            ctx = ssl.create_default_context(cafile=self.cacert) if self.cacert else None
            self._session = aiohttp.ClientSession(
                headers=headers,
                connector=aiohttp.TCPConnector(ssl=ctx) if ctx is not None else None,
            )
        return self._session

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        timeout: float,
        raw: bool = False,
        data: bytes | Path | None = None,
        retry: Retry | None = None,
        deadline: float | None = None,
    ) -> Any:
        """The JSON answer to one call (or its bytes with `raw`); typed errors otherwise.
        `body` is sent as JSON (a `proto.api` struct, or JSON-able data), `data` as it is
        (bytes, or a file read anew for each try). `timeout`: seconds for each try. `retry`
        (default: by method, `default_retry`) says which failures are tried again, for at
        most `retry_s` seconds and never past `deadline` (a `time.monotonic()` time)."""
        import tenacity

        headers = None
        if isinstance(body, msgspec.Struct):
            body, data = None, msgspec.json.encode(body)
            headers = {"Content-Type": "application/json"}
        when = retry or default_retry(method)
        start = time.monotonic()
        end = start + (self.retry_s if when != "never" else 0.0)
        if deadline is not None:
            end = min(end, deadline)

        def again(exc: BaseException) -> bool:
            return isinstance(exc, _Failed) and (when == "any" or not exc.sent)

        def before_sleep(state: tenacity.RetryCallState) -> None:
            log.info(
                "%s %s failed (%s); trying again in %.1f s",
                method, path, state.outcome.exception() if state.outcome else "?",
                state.upcoming_sleep,
            )  # fmt: skip

        b = self.backoff
        retrying = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception(again),
            wait=tenacity.wait_exponential(multiplier=b.first_s, max=b.max_s)
            + tenacity.wait_random(0, b.jitter_s),
            stop=lambda state: time.monotonic() + state.upcoming_sleep >= end,
            before_sleep=before_sleep,
            reraise=True,  # the last failure itself, not a RetryError
        )
        tries = 0
        try:
            async for attempt in retrying:
                with attempt:
                    tries += 1
                    answer = await self._try(method, path, body, data, headers, timeout)
            return answer if raw else _json(answer, method, path)
        except _Failed as failed:
            error = failed.error
            if tries > 1 and isinstance(error, BrokerUnreachable):
                seconds = time.monotonic() - start
                error = BrokerUnreachable(
                    f"{error} (tried {tries} times over {seconds:.1f} s)", sent=error.sent
                )
            raise error from None

    async def _try(
        self,
        method: str,
        path: str,
        body: Any,
        data: bytes | Path | None,
        headers: dict[str, str] | None,
        timeout: float,
    ) -> bytes:
        """One try: the answer's bytes, or `_Failed` for what a later try may mend."""
        import aiohttp

        wait = aiohttp.ClientTimeout(total=timeout)
        where = f"the broker at {self.url}"
        try:
            if isinstance(data, Path):
                with data.open("rb") as f:  # aiohttp reads it in chunks
                    return await self._send(method, path, body, f, headers, wait)
            return await self._send(method, path, body, data, headers, wait)
        except TimeoutError:
            raise BrokerUnreachable(
                f"{where} did not answer {method} {path} within {timeout:g} s"
            ) from None
        except aiohttp.ClientSSLError as exc:
            raise BrokerUnreachable(f"cannot reach {where} over TLS: {exc}", sent=False) from None
        except _dns_errors() as exc:
            raise BrokerUnreachable(f"cannot reach {where}: {exc}", sent=False) from None
        except aiohttp.ClientConnectorError as exc:  # connecting failed: nothing was sent
            error = BrokerUnreachable(f"cannot reach {where}: {_why(exc)}", sent=False)
            raise _Failed(error, sent=False) from None
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            error = BrokerUnreachable(
                f"the connection to {where} broke during {method} {path}: {_why(exc)}"
            )
            raise _Failed(error, sent=True) from None
        except aiohttp.ClientError as exc:
            raise FusionAIError(f"{method} {self.url}{path} failed: {_why(exc)}") from None

    async def _send(
        self, method: str, path: str, body: Any, data: Any, headers: Any, wait: Any
    ) -> bytes:
        async with self.session().request(
            method, self.url + path, json=body, data=data, timeout=wait, headers=headers
        ) as resp:
            answer: bytes = await resp.read()
            if resp.status >= 400:
                error = _error(resp.status, answer, resp.headers.get("Retry-After"))
                if resp.status in RETRY_STATUS:
                    raise _Failed(error, sent=True)
                raise error
            return answer


@functools.cache
def _dns_errors() -> tuple[type[Exception], ...]:
    import aiohttp

    found = getattr(aiohttp, "ClientConnectorDNSError", None)  # aiohttp 3.11 and later
    return (found,) if found is not None else ()


def _why(exc: Exception) -> str:
    return str(exc) or type(exc).__name__


def _json(answer: bytes, method: str, path: str) -> Any:
    try:
        return json.loads(answer)
    except ValueError:
        raise FusionAIError(
            f"the broker's answer to {method} {path} is not JSON (is the URL a FusionAI broker?)"
        ) from None


def _error(status: int, data: bytes, retry_after: str | None) -> FusionAIError:
    message, field_name = data.decode(errors="replace")[:500], None
    try:
        err = json.loads(data)["error"]
        message, field_name = str(err["message"]), err.get("field")
    except (ValueError, KeyError, TypeError):
        pass
    retry = float(retry_after) if retry_after and retry_after.isdigit() else None
    return for_status(status, message, field_name, retry)
