"""Upstream failures as the front sees them (STYLE 4: errors mapped at the layer edge).

Every httpx failure of one upstream attempt becomes an UpstreamError whose ``reason`` is a
metric label and whose ``retryable`` says whether the front may try the next candidate: true
only while nothing of this attempt's answer has been relayed.
"""

from __future__ import annotations

import httpx

from gridd.errors import GriddError

__all__ = ["UpstreamError", "answered_error_status", "broke_mid_body", "failed_before_answer"]


class UpstreamError(GriddError):
    """An upstream attempt that produced nothing the front could relay (or broke mid-body).

    reason (metric label): connect (no connection), dropped (connection lost before any
    response byte), connect_timeout, header_timeout, first_byte_timeout, status (answered
    5xx), protocol (an unusable request or answer), stream_broken (the body failed after
    headers).
    """

    reason = "upstream"

    def __init__(self, message: str, *, reason: str, retryable: bool, status: int | None = None) -> None:
        super().__init__(message, reason=reason)
        self.retryable = retryable
        self.status = status


def failed_before_answer(exc: httpx.TransportError | httpx.InvalidURL, url: httpx.URL, *,
                         connected: bool) -> UpstreamError:
    """An attempt that got no response headers: ``connected`` is whether a connection was ready
    and the request started going out (a protocol failure after that is not retried)."""
    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)):
        return UpstreamError(f"cannot connect to {url}: {exc!r}", reason="connect", retryable=True)
    if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)):
        # Dropped before any response byte: a dead upstream, or a pooled connection the server
        # closed as we reused it. Nothing reached the client, so the next candidate may serve.
        return UpstreamError(f"{url} dropped the request before answering: {exc!r}", reason="dropped",
                             retryable=True)
    return UpstreamError(f"request to {url} failed: {exc!r}", reason="protocol", retryable=not connected)


def answered_error_status(url: httpx.URL, status: int) -> UpstreamError:
    """A 5xx answer: nothing of it is relayed, so the next candidate may serve."""
    return UpstreamError(f"{url} answered {status}", reason="status", retryable=True, status=status)


def broke_mid_body(url: httpx.URL, exc: httpx.TransportError) -> UpstreamError:
    """The body failed after the headers: never retried (part of it may have been relayed)."""
    return UpstreamError(f"{url} broke mid-body: {exc!r}", reason="stream_broken", retryable=False)
