"""The probe runner (spec 004): one task per enabled probe, at the operator (DESIGN 5).

    tick -> fetch(endpoint) -> extract -> aggregate (sliding window) -> publish (sinks)

Supervision (STYLE 7). Each probe runs under its own cancel scope in a map keyed by
(provider, probe name). ``update(providers)`` diffs the wanted probes against the running
ones: a probe that is new or newly enabled starts, one removed or disabled (or whose
provider was removed or disabled) stops, one whose effective spec changed restarts, and
every other probe keeps running untouched, on its own schedule, with its window. The spec
compared is the ProbeConfig struct plus what it resolves to: the URL (a probe without an
endpoint uses the provider's ``settings.endpoint``), the auth headers sent, and the file
paths. A restart starts a fresh window; the tick and failure counters are kept while the
probe stays configured. ``stop_all`` (drain) stops every probe.

Schedule (DESIGN 5b; STYLE 9). Ticks run start-to-start on a fixed grid: tick k starts at
``origin + k * interval`` (``trio.sleep_until``, computed from the origin, so no drift
accumulates), however long the previous tick took. A tick that runs past one or more grid
points skips them (counted as ``skipped_ticks``) and the next tick starts at the first grid
point not yet passed: the schedule never bursts to catch up. The first tick is at start.

One tick. The request is bounded by the probe's ``timeout``, owned here by the caller
(STYLE 3: trio.move_on_after around fetch_capped), and the wait for a slot of the probes'
CapacityLimiter is inside that bound. The body is read through the operator's body cap
(fetch_capped, the scrape path's failure classes). A 2xx body from which no rule extracted
a value fails as ``extract``. A failed tick never stops the probe: it counts a failure by
class and leaves the window, and the values already published, as they were until the next
successful tick (spec 004, Tips). A successful tick feeds the window (gridd.core.probes.
ProbeSeries) and publishes every aggregate to the sinks, metadata first, so a slow disk
never delays routing's values; a sink error (disk full, permission) is counted and logged
once per run of errors, and never stops the probe. A bug in a tick is logged and counted
(``internal``); the probe goes on at its next grid point.

Credentials. A probe's own ``auth`` block is sent to its endpoint; without one, the provider's
auth (bearer or header, and its custom headers) is sent only to the provider's own origin
(scheme, host and port of ``settings.endpoint``): a probe of another host never receives the
provider's secret (gridd.credentials.credentials_for; docs/security.md).
"""

from __future__ import annotations

import logging
import math
import pathlib
from collections.abc import Callable
from typing import Any

import httpx
import msgspec
import trio

from gridd.config_schema import ProbeConfig, ProviderConfig
from gridd.core.probes import Extractor, ExtractTimeout, ProbeSeries
from gridd.core.publication import ProviderPublisher
from gridd.credentials import credentials_for
from gridd.operator.scrape import FAILURE_CLASSES, ScrapeTarget, fetch_capped
from gridd.probes.sinks import (
    SINK_ERRORS,
    FileSink,
    JsonlHistory,
    MetadataSink,
    RunIO,
    file_sink_path,
)

log = logging.getLogger("gridd.probes")

PROBE_FAILURE_CLASSES = (*FAILURE_CLASSES, "extract", "extract_timeout", "internal")

ProbeKey = tuple[str, str]
"""(provider name, probe name)."""


class ProbeSpec(msgspec.Struct, frozen=True):
    """What one running probe was started from; a change to any of it restarts the probe."""

    provider: str
    probe: ProbeConfig
    url: str
    headers: dict[str, str]
    files: tuple[str, ...]
    """Resolved paths of the file sinks, in ``publish`` order."""


def probe_specs(
    providers: list[ProviderConfig], resolve: Callable[[str], pathlib.Path]
) -> dict[ProbeKey, ProbeSpec]:
    """The probes that should run: the enabled probes of the enabled providers."""
    wanted: dict[ProbeKey, ProbeSpec] = {}
    for provider in providers:
        if not provider.enabled:
            continue
        for probe in provider.settings.probes:
            if not probe.enabled:
                continue
            url = probe.endpoint or provider.settings.endpoint
            files = tuple(str(file_sink_path(resolve, s.path))
                          for s in probe.publish if s.to == "file" and s.path)
            wanted[(provider.name, probe.name)] = ProbeSpec(provider.name, probe, url,
                                                            credentials_for(url, probe.auth, provider), files)
    return wanted


class ProbeStats:
    """Counters of one configured probe; kept across restarts, dropped when it stops."""

    __slots__ = ("ticks", "failures", "skipped_ticks", "dropped_series", "sink_errors", "series",
                 "last_tick_at", "last_success_at", "last_failure_at", "last_failure_class",
                 "last_failure_detail", "started_at", "restarts")

    def __init__(self) -> None:
        self.ticks = 0
        self.failures: dict[str, int] = {}
        self.skipped_ticks = 0
        self.dropped_series = 0
        self.sink_errors: dict[str, int] = {}
        self.series = 0
        self.last_tick_at: float | None = None
        self.last_success_at: float | None = None
        self.last_failure_at: float | None = None
        self.last_failure_class: str | None = None
        self.last_failure_detail = ""
        self.started_at: float | None = None
        self.restarts = 0


class ProbeTask:
    def __init__(self, spec: ProbeSpec, stats: ProbeStats, sinks: list[MetadataSink | FileSink]) -> None:
        self.spec = spec
        self.stats = stats
        self.sinks = sinks
        self.scope = trio.CancelScope()
        self.extractor = Extractor(spec.probe.extract)
        self.series = ProbeSeries(window=spec.probe.aggregate.window, method=spec.probe.aggregate.method,
                                  max_series=spec.probe.max_series)
        self.failing_sinks: set[int] = set()

    def stop(self) -> None:
        self.scope.cancel()
        for sink in self.sinks:
            if isinstance(sink, MetadataSink):
                sink.close()


class _MethodClient:
    """fetch_capped always GETs; a probe configured with POST or HEAD goes through this view
    of the shared client, which sends the probe's method instead (same pool, same errors)."""

    def __init__(self, client: httpx.AsyncClient, method: str) -> None:
        self._client = client
        self._method = method

    def stream(self, _method: str, url: str, **kwargs: Any) -> Any:
        return self._client.stream(self._method, url, **kwargs)


class ProbeRunner:
    def __init__(
        self,
        *,
        publisher: Callable[[str], ProviderPublisher | None],
        resolve: Callable[[str], pathlib.Path],
        body_cap: Callable[[], int],
        wall: Callable[[], float],
        concurrency: int = 16,
        run_io: RunIO = trio.to_thread.run_sync,
    ) -> None:
        self.publisher = publisher
        self.resolve = resolve
        self.body_cap = body_cap
        self.wall = wall
        self.run_io = run_io
        self.limiter = trio.CapacityLimiter(concurrency)
        self.tasks: dict[ProbeKey, ProbeTask] = {}
        self.stats: dict[ProbeKey, ProbeStats] = {}
        self.histories: dict[pathlib.Path, JsonlHistory] = {}
        self.client: httpx.AsyncClient | None = None
        self._nursery: trio.Nursery | None = None

    @property
    def running(self) -> bool:
        return self._nursery is not None

    async def run(self, client: httpx.AsyncClient, providers: list[ProviderConfig], *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the probes of ``providers`` until cancelled; ``update`` changes the set."""
        self.client = client
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                self.update(providers)
                task_status.started()
                await trio.sleep_forever()
            finally:
                self._nursery = None
                self.stop_all()

    def update(self, providers: list[ProviderConfig]) -> dict[str, list[ProbeKey]]:
        """Diff and apply (module docstring). Returns the keys started, restarted and stopped."""
        assert self._nursery is not None, "update() before run()"
        wanted = probe_specs(providers, self.resolve)
        changes: dict[str, list[ProbeKey]] = {"started": [], "restarted": [], "stopped": []}
        touched: set[str] = set()
        for key, task in list(self.tasks.items()):
            if key not in wanted:
                task.stop()
                del self.tasks[key]
                self.stats.pop(key, None)
                changes["stopped"].append(key)
                touched.add(key[0])
            elif wanted[key] != task.spec:
                task.stop()
                del self.tasks[key]
                changes["restarted"].append(key)
                touched.add(key[0])
        for key, spec in wanted.items():
            if key in self.tasks:
                continue
            stats = self.stats.get(key)
            if stats is None:
                stats = self.stats[key] = ProbeStats()
                changes["started"].append(key)
            else:
                stats.restarts += 1
            task = self.tasks[key] = ProbeTask(spec, stats, self._sinks(spec))
            for index, reason in task.extractor.refused:
                log.warning("probe %s/%s: extract[%d] refused: %s", spec.provider, spec.probe.name, index,
                            reason)
            self._nursery.start_soon(self._run_probe, task, name=f"probe:{spec.provider}/{spec.probe.name}")
        in_use = {pathlib.Path(p) for task in self.tasks.values() for p in task.spec.files}
        for path in [p for p in self.histories if p not in in_use]:
            del self.histories[path]
        # A stopped or restarted probe's values leave the metadata now, synchronously, so no
        # batch published after this reload carries them.
        for provider in touched:
            self._merge_metadata(provider)
        return changes

    def stop_all(self) -> None:
        providers = {key[0] for key in self.tasks}
        for task in self.tasks.values():
            task.stop()
        self.tasks.clear()
        self.stats.clear()
        for provider in providers:
            self._merge_metadata(provider)

    def _merge_metadata(self, provider: str) -> None:
        """ProviderPublisher.probes is the union of the provider's running metadata sinks,
        in probe start order (a name two probes publish under one prefix: the later wins).
        The publisher is looked up each time: a re-created provider has a new one."""
        publisher = self.publisher(provider)
        if publisher is None:
            return
        merged: dict[str, float] = {}
        produced_at: dict[str, float] = {}
        for (owner, _), task in self.tasks.items():
            if owner == provider:
                for sink in task.sinks:
                    if isinstance(sink, MetadataSink) and sink.published_at is not None:
                        merged.update(sink.values)
                        produced_at.update(dict.fromkeys(sink.values, sink.published_at))
        publisher.probes.clear()
        publisher.probes.update(merged)
        publisher.probes_at.clear()
        publisher.probes_at.update(produced_at)

    def _sinks(self, spec: ProbeSpec) -> list[MetadataSink | FileSink]:
        sinks: list[MetadataSink | FileSink] = []
        for sink in spec.probe.publish:
            if sink.to == "metadata":
                sinks.append(MetadataSink(spec.provider, sink.prefix, self._merge_metadata))
            elif sink.path:
                path = file_sink_path(self.resolve, sink.path)
                history = self.histories.get(path)
                if history is None:
                    history = self.histories[path] = JsonlHistory(path, sink.max_entries, self.run_io,
                                                                      root=self.resolve("."))
                history.max_entries = sink.max_entries
                sinks.append(FileSink(history, provider=spec.provider, probe=spec.probe.name, wall=self.wall))
        return sinks

    # -- one probe ------------------------------------------------------------------------------

    async def _run_probe(self, task: ProbeTask) -> None:
        stats, interval = task.stats, task.spec.probe.interval
        with task.scope:
            origin = trio.current_time()
            stats.started_at = origin
            k = 0
            while True:
                await trio.sleep_until(origin + k * interval)
                try:
                    await self._tick(task)
                except Exception:
                    self._fail(task, trio.current_time(), "internal", "the tick raised; see the log")
                    log.exception("probe %s/%s: tick failed", task.spec.provider, task.spec.probe.name)
                # Start-to-start on a fixed grid; an overrun skips the grid points it passed.
                k += 1
                now = trio.current_time()
                if origin + k * interval < now:
                    first_not_passed = math.ceil((now - origin) / interval)
                    stats.skipped_ticks += first_not_passed - k
                    k = first_not_passed

    async def _tick(self, task: ProbeTask) -> None:
        spec, stats = task.spec, task.stats
        probe = spec.probe
        stats.ticks += 1
        stats.last_tick_at = trio.current_time()
        assert self.client is not None
        client = self.client if probe.method == "GET" else _MethodClient(self.client, probe.method)
        target = ScrapeTarget(spec.provider, spec.url, probe.timeout, spec.headers)
        body: bytes | None = None
        failure: str | None = "timeout"
        detail = f"no answer within {probe.timeout:g} s"
        with trio.move_on_after(probe.timeout):
            async with self.limiter:
                body, failure, detail = await fetch_capped(client, target, self.body_cap())  # type: ignore[arg-type]
        values: dict[str, float] = {}
        if failure is None and body is not None:
            try:
                values = task.extractor.extract(body)
            except ExtractTimeout as exc:
                failure, detail = "extract_timeout", str(exc)
            if failure is None and not values:
                failure, detail = "extract", "no extract rule found a numeric value in the body"
        now = trio.current_time()
        if failure is not None:
            # The window and the published values stay as they were (spec 004).
            self._fail(task, now, failure, detail)
            return
        observation = task.series.observe(values)
        if stats.last_failure_class is not None:
            log.info("probe %s/%s: answering again", spec.provider, probe.name)
        stats.last_success_at = now
        stats.last_failure_class, stats.last_failure_detail = None, ""
        stats.dropped_series += observation.dropped
        stats.series = len(task.series)
        for index, sink in enumerate(task.sinks):
            try:
                if isinstance(sink, MetadataSink):
                    sink.publish(observation.aggregates, now)
                else:
                    await sink.publish(observation.aggregates)
            except SINK_ERRORS as exc:
                stats.sink_errors[sink.kind] = stats.sink_errors.get(sink.kind, 0) + 1
                if index not in task.failing_sinks:
                    task.failing_sinks.add(index)
                    log.warning("probe %s/%s: %s sink failed (logged once until it recovers): %s",
                                spec.provider, probe.name, sink.kind, exc)
            else:
                if index in task.failing_sinks:
                    task.failing_sinks.discard(index)
                    log.info("probe %s/%s: %s sink writing again", spec.provider, probe.name, sink.kind)

    def _fail(self, task: ProbeTask, now: float, failure: str, detail: str) -> None:
        stats = task.stats
        stats.failures[failure] = stats.failures.get(failure, 0) + 1
        if stats.last_failure_class is None:
            log.warning("probe %s/%s failed (%s): %s; keeping its last values",
                        task.spec.provider, task.spec.probe.name, failure, detail)
        stats.last_failure_at = now
        stats.last_failure_class, stats.last_failure_detail = failure, detail

    # -- what gridctl and the exporter see ------------------------------------------------------

    def snapshot(self) -> list[tuple[ProbeKey, ProbeStats]]:
        return list(self.stats.items())

    def status(self, provider: ProviderConfig, now: float) -> list[dict[str, Any]]:
        """Every configured probe of ``provider``; those not running say why."""
        out = []
        for probe in provider.settings.probes:
            task = self.tasks.get((provider.name, probe.name))
            if task is None:
                why = "disabled" if not probe.enabled else ("provider disabled" if not provider.enabled
                                                             else "stopped")
                out.append({"name": probe.name, "running": False, "state": why})
                continue
            s = task.stats
            out.append({
                "name": probe.name,
                "running": True,
                "state": "failing" if s.last_failure_class is not None else "ok",
                "endpoint": task.spec.url,
                "interval_s": probe.interval,
                "ticks": s.ticks,
                "failures": dict(s.failures),
                "last_failure_class": s.last_failure_class,
                "last_failure_detail": s.last_failure_detail,
                "last_success_age_s": (None if s.last_success_at is None
                                       else round(now - s.last_success_at, 3)),
                "series": s.series,
                "dropped_series": s.dropped_series,
                "skipped_ticks": s.skipped_ticks,
                "sink_errors": dict(s.sink_errors),
                "refused_rules": [{"extract": i, "reason": r} for i, r in task.extractor.refused],
            })
        return out
