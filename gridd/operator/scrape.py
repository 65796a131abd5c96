"""The scrape pool: every interval, one pass over every enabled provider's /metrics.

At most ``concurrency`` (16) scrapes run at once: a pass runs that many worker tasks over
its target list, each scraping one target at a time (the one bound and the one queue,
STYLE 8). The client is the lean keep-alive ScrapeClient (gridd.operator.http1,
``make_scrape_client``), which has no queue of its own, or an httpx client (``make_client``:
the probes' client, tests' MockTransport) whose pool is sized at or above the bound so it
never becomes a hidden queue. Each scrape is bounded
by its provider's timeout, owned here by the caller (STYLE 3), so a hanging provider costs
one slot for that long and never delays the others beyond the pool bound. A pass starts no
sooner than one interval after the previous pass started, and never overlaps it; its
duration is recorded because the readiness floor depends on it (spec: Provider Readiness).
"""

from __future__ import annotations

import logging
import math
import ssl
from collections.abc import Awaitable, Callable, Iterator, Sequence

import httpx
import msgspec
import trio

from gridd.core.transitions import TransitionLog
from gridd.link.periodic import run_periodic
from gridd.operator.http1 import ScrapeClient, is_tls_error

log = logging.getLogger("gridd.scrape")

# What a scrape itself can fail with; the publisher adds "wrong_kind" (a body not of the
# configured metrics.kind; gridd.core.readiness.FAILURE_CLASSES has every class).
FAILURE_CLASSES = ("timeout", "connect", "tls", "http_status", "body_cap", "parse")


PASS_FITS_AGAIN_AT = 0.9
"""Passes that overran the scrape interval fit again once one takes at most this share of it:
a pass hovering at the interval logs no pair of lines per pass (ScrapePool._note_pace)."""


def overrunning_after(overrunning: bool, duration_s: float, interval_s: float) -> bool:
    """Whether passes overrun their interval after a pass of ``duration_s``: from a pass longer
    than the interval until one of at most PASS_FITS_AGAIN_AT of it."""
    return duration_s > (PASS_FITS_AGAIN_AT * interval_s if overrunning else interval_s)


class ScrapeTarget(msgspec.Struct, frozen=True):
    provider: str
    url: str
    timeout_s: float
    headers: dict[str, str] = {}


class ScrapeResult(msgspec.Struct, frozen=True):
    """What one scrape returned. ``body`` is set only on success; ``failure_class`` is one of
    FAILURE_CLASSES otherwise. ``finished_at`` is trio time (monotonic)."""

    provider: str
    finished_at: float
    duration_s: float
    body: bytes | None = None
    failure_class: str | None = None
    detail: str = ""


async def fetch_capped(
    client: httpx.AsyncClient, target: ScrapeTarget, body_cap: int
) -> tuple[bytes | None, str | None, str]:
    """GET the target, reading at most ``body_cap`` decoded bytes. Returns (body, failure
    class, detail). A body of exactly ``body_cap`` bytes is accepted; one byte more is
    ``body_cap`` (DESIGN 5b), and the rest of it is never read."""
    try:
        async with client.stream("GET", target.url, headers=target.headers) as response:
            if not 200 <= response.status_code < 300:
                return None, "http_status", f"HTTP {response.status_code}"
            chunks: list[bytes] = []
            size = 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > body_cap:
                    return None, "body_cap", f"body over {body_cap} bytes"
                chunks.append(chunk)
            return b"".join(chunks), None, ""
    except httpx.HTTPError as exc:
        # Map errors at the layer edge (STYLE 4): TLS trouble surfaces from httpx as a
        # ConnectError whose cause is an ssl error; a broken or malformed response mid-way
        # is a transport failure of the connection.
        if is_tls_error(exc):
            return None, "tls", f"TLS: {exc}"
        if isinstance(exc, httpx.DecodingError):
            return None, "parse", f"undecodable body: {exc}"
        if isinstance(exc, httpx.TimeoutException):
            return None, "timeout", str(exc) or type(exc).__name__
        return None, "connect", f"{type(exc).__name__}: {exc}"
    except (ssl.SSLError, ssl.CertificateError) as exc:
        return None, "tls", f"TLS: {exc}"
    except OSError as exc:
        return None, "connect", f"{type(exc).__name__}: {exc}"
    except (httpx.InvalidURL, UnicodeError, ValueError) as exc:
        # A target httpx cannot even send (a malformed URL, a header it cannot encode):
        # the scrape fails like an unreachable one; it must never take the pool down.
        return None, "connect", f"cannot send the request: {type(exc).__name__}: {exc}"


Client = ScrapeClient | httpx.AsyncClient


async def _fetch(client: Client, target: ScrapeTarget, body_cap: int) -> tuple[bytes | None, str | None, str]:
    if isinstance(client, ScrapeClient):
        return await client.get_capped(target.url, target.headers, body_cap)
    return await fetch_capped(client, target, body_cap)


def _timed_out(target: ScrapeTarget, start: float, end: float) -> ScrapeResult:
    return ScrapeResult(target.provider, end, end - start, None, "timeout",
                        f"no answer within {target.timeout_s:g} s")


async def scrape_one(client: Client, target: ScrapeTarget, body_cap: int) -> ScrapeResult:
    start = trio.current_time()
    # The provider's timeout, owned here (STYLE 3): move_on_after(timeout_s), built directly.
    with trio.CancelScope(deadline=start + target.timeout_s) as scope:
        body, failure, detail = await _fetch(client, target, body_cap)
    end = trio.current_time()
    if scope.cancelled_caught:
        return _timed_out(target, start, end)
    return ScrapeResult(target.provider, end, end - start, body, failure, detail)


def make_scrape_client(verify: ssl.SSLContext | bool = True) -> ScrapeClient:
    """The scrape pool's client: keep-alive per provider, no queue of its own (the pool's
    workers bound it), the same TLS verification as ``make_client``."""
    return ScrapeClient(verify=verify)


def make_client(concurrency: int, verify: ssl.SSLContext | bool = True) -> httpx.AsyncClient:
    # httpx's pool at or above the pool's bound, so it never becomes a hidden queue (STYLE 8).
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    return httpx.AsyncClient(
        limits=limits,
        timeout=None,
        verify=verify,
        follow_redirects=False,
        # identity: the body cap counts decoded bytes, and a compressed chunk could
        # otherwise expand far past it before the cap is checked.
        headers={"accept": "text/plain;version=0.0.4;q=1,*/*;q=0.1", "accept-encoding": "identity"},
    )


# How often at most a pass hands its finished scrapes on (``ScrapePool``): the first result
# after a quiet spell goes at once, the ones finishing within this long after a hand-on wait
# for the next, and then go together. ScrapePool.run takes at most a scrape interval's
# twentieth of it.
HAND_ON_EVERY_S = 0.05


class ScrapePool:
    """Runs passes; hands each finished scrape to ``on_result``, in the order the scrapes
    finished, and each pass's duration to ``on_pass`` once the slowest scrape of the pass is
    done and every result of the pass has been handed on.

    Results are handed on in rounds, at most one round every ``hand_on_gap_s``
    (``hand_on_every_s``, or a twentieth of the pass's scrape interval when that is shorter):
    a result that finishes after a quiet spell is handed on at once, one that finishes sooner
    after the last round waits (at most the gap) for the next round with whatever else
    finished meanwhile. One round handles its results back to back, so the code and data of
    the parse stay in the CPU's caches from one provider to the next: at 1000 providers a
    second, handing each result on as it came cost a sixth to a third more CPU
    (docs/scaling.md). The scrapes never wait for it: a worker goes on to its next target as
    soon as a scrape ends. ``ScrapeResult.finished_at`` stays the moment the scrape ended."""

    def __init__(
        self,
        client: Client,
        *,
        concurrency: int,
        body_cap: int,
        on_result: Callable[[ScrapeResult], Awaitable[None] | None],
        on_pass: Callable[[float, float], None] | None = None,
        hand_on_every_s: float = HAND_ON_EVERY_S,
    ) -> None:
        self.client = client
        self.concurrency = concurrency
        self.body_cap = body_cap
        self.on_result = on_result
        self.on_pass = on_pass
        self.hand_on_every_s = hand_on_every_s
        # The gap between hand-on rounds in the running pass (run_pass's interval_s).
        self.hand_on_gap_s = hand_on_every_s
        self.last_pass_s: float | None = None
        # When the running pass started (None between passes): the readiness floor counts
        # a running pass once it has run longer than the last one (measured_pass_s).
        self.pass_started_at: float | None = None
        self.passes = 0
        # Whether the latest passes overran their interval (overrunning_after), and the running
        # pass's slowest scrape so far (what the line saying so names).
        self.overrunning = False
        self._pace_lines = TransitionLog()
        self._slowest: ScrapeResult | None = None
        self.max_in_flight_seen = 0
        self.result_errors = 0
        self._in_flight = 0
        # The running pass's results not yet handed on, in the order they finished; its
        # workers still scraping; the pass's own task waiting for either to change.
        self._finished: list[ScrapeResult] = []
        self._workers_left = 0
        self._results_or_end = trio.lowlevel.ParkingLot()
        self._workers_end = trio.lowlevel.ParkingLot()
        self._last_hand_on = -math.inf

    async def run_pass(self, targets: Sequence[ScrapeTarget], *, interval_s: float | None = None) -> float:
        """One pass over ``targets``; its duration. ``interval_s``: the scrape interval the pass
        runs at, whose twentieth bounds the gap between hand-on rounds."""
        self.hand_on_gap_s = (self.hand_on_every_s if interval_s is None
                              else min(self.hand_on_every_s, interval_s / 20))
        start = self.pass_started_at = trio.current_time()
        # ``concurrency`` workers take the pass's targets in order, one scrape at a time each:
        # at most ``concurrency`` scrapes at once, and a target waits for the first worker to
        # come free, as it waited for a slot of a CapacityLimiter (STYLE 8: one bound, one
        # queue, here the list itself). A worker spawned per pass, not a task per scrape:
        # the same bound and order for a fraction of trio's cost per scrape. The pass's own
        # task hands the results on (_hand_on_until_done).
        pending = iter(targets)
        self._finished = []
        self._slowest = None
        try:
            async with trio.open_nursery() as nursery:
                for worker in range(min(self.concurrency, len(targets))):
                    self._workers_left += 1
                    nursery.start_soon(self._scrape_worker, pending, name=f"scrape-worker:{worker}")
                    # Let it take its first target before the next worker starts: the first
                    # scrapes begin in target order, as they did with a task per target.
                    await trio.lowlevel.checkpoint()
                await self._hand_on_until_done()
        finally:
            self.pass_started_at = None
            self._workers_left = 0
        duration = trio.current_time() - start
        self.last_pass_s = duration
        self.passes += 1
        if interval_s is not None:
            self._note_pace(duration, interval_s, len(targets))
        if self.on_pass is not None:
            self.on_pass(start, duration)
        return duration

    def _note_pace(self, duration_s: float, interval_s: float, targets: int) -> None:
        """One line when passes start to overrun the scrape interval, one when they fit again.
        An overrunning pass delays the next (passes never overlap), so every provider is read
        once a pass instead of once an interval (docs/scaling.md, "The 16-slot pool")."""
        self.overrunning = overrunning_after(self.overrunning, duration_s, interval_s)
        # Rate-limited like every transition line (a provider hanging every other pass flaps).
        line = self._pace_lines.observe("pace", "overrunning" if self.overrunning else "fits",
                                        trio.current_time(), baseline="fits")
        if line is None:
            return
        if not self.overrunning:
            log.info("scrape passes fit the interval again: %.2f s for timings.scrape_interval_s %g%s",
                     duration_s, interval_s, line.suffix())
            return
        slowest = self._slowest
        log.warning(
            "scrape pass took %.2f s, longer than timings.scrape_interval_s %g (%d providers, at most %d "
            "at once; slowest scrape %s): each provider is read once a pass, not once an interval; for many "
            "providers raise timings.scrape_concurrency, for a slow one see its metrics.timeout_s "
            "(docs/scaling.md)%s",
            duration_s, interval_s, targets, self.concurrency,
            "none" if slowest is None else f"{slowest.duration_s:.2f} s, provider {slowest.provider}",
            line.suffix(),
        )

    async def _scrape_worker(self, pending: Iterator[ScrapeTarget]) -> None:
        """Scrape targets from ``pending`` (the pass's one iterator: each target goes to one
        worker) until none is left, leaving each result for the pass to hand on.

        Each scrape is bounded by its provider's timeout exactly as scrape_one bounds it
        (the caller's cancel scope, STYLE 3), but one scope serves many scrapes in a row:
        its deadline is set to each scrape's start + timeout_s. A scope whose deadline fired
        is spent, so the next scrape gets a new one; that costs a scope per timeout, not one
        per scrape."""
        client, body_cap = self.client, self.body_cap
        # The lean client's own method, without _fetch's coroutine around it per scrape.
        fetch = client.get_capped if isinstance(client, ScrapeClient) else None
        try:
            while True:
                with trio.CancelScope() as scope:
                    for target in pending:
                        start = trio.current_time()
                        scope.deadline = start + target.timeout_s
                        self._in_flight += 1
                        self.max_in_flight_seen = max(self.max_in_flight_seen, self._in_flight)
                        try:
                            if fetch is not None:
                                body, failure, detail = await fetch(target.url, target.headers, body_cap)
                            else:
                                body, failure, detail = await _fetch(client, target, body_cap)
                        finally:
                            self._in_flight -= 1
                        end = trio.current_time()
                        self._finish(ScrapeResult(target.provider, end, end - start, body, failure, detail))
                        if scope.cancel_called:
                            # The deadline passed as the answer came in: the answer stands;
                            # the next scrape gets a new scope.
                            break
                    else:
                        return
                if scope.cancelled_caught:
                    # The deadline fired during the scrape of ``target``, begun at ``start``.
                    self._finish(_timed_out(target, start, trio.current_time()))
        finally:
            self._workers_left -= 1
            if not self._workers_left:
                self._workers_end.unpark_all()
                self._results_or_end.unpark_all()

    def _finish(self, result: ScrapeResult) -> None:
        self._finished.append(result)
        if self._slowest is None or result.duration_s > self._slowest.duration_s:
            self._slowest = result
        if self._results_or_end:
            self._results_or_end.unpark_all()

    async def _hand_on_until_done(self) -> None:
        """Hand the pass's results on as they finish, at most one round every
        ``hand_on_gap_s`` (class docstring), until every worker is done and every result
        handed on. The last round goes as soon as the last worker is done."""
        while self._finished or self._workers_left:
            if not self._finished:
                await self._results_or_end.park()
                continue
            due = self._last_hand_on + self.hand_on_gap_s
            if self._workers_left and trio.current_time() < due:
                with trio.move_on_at(due):
                    await self._workers_end.park()
            results, self._finished = self._finished, []
            self._last_hand_on = trio.current_time()
            for result in results:
                try:
                    outcome = self.on_result(result)
                    if outcome is not None:
                        # A handler that waits (a publisher epoch to claim first) holds up the
                        # results after it, never the scrapes.
                        await outcome
                except Exception:
                    # A bug on one provider's result path must not stop every provider's scraping.
                    self.result_errors += 1
                    log.exception("provider %s: processing the scrape result failed", result.provider)

    async def run(
        self,
        interval_s: Callable[[], float],
        targets: Callable[[], Sequence[ScrapeTarget]],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Pass after pass on the shared periodic loop (gridd/link/periodic.py): the next
        starts one interval after the previous one was scheduled to start, or as soon as it
        ends if it ran longer (never overlapping). Drift-free: a late wake-up does not
        shift the schedule (STYLE 9). Interval and targets are read anew each pass, so a
        committed reload takes effect at the next pass."""
        task_status.started()

        async def one_pass() -> None:
            await self.run_pass(targets(), interval_s=interval_s())

        await run_periodic(interval_s, one_pass)
