"""The operator role (DESIGN.md 4): scrape pool, probes, exporter, signals server, peer pollers.

The trio tasks here only move data: scrape results go into the pure per-provider
publishers (gridd.core.publication), their batches into the holdings (gridd.core.holdings),
which the exporter, the signals server and gridctl read.
"""

from __future__ import annotations

import itertools
import logging
import random
import ssl
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from functools import partial
from typing import Any

import httpx
import msgspec
import trio
from prometheus_client import CollectorRegistry, Counter

from gridd.api.access import check_api_exposure
from gridd.api.providers import ProvidersAPI
from gridd.clock import wall_clock
from gridd.config import LoadedConfig, http_limits
from gridd.config_schema import Config, PeerConfig, ProviderConfig
from gridd.core.admission import AdmissionFences
from gridd.core.feedback import GatewayEvidenceLedger
from gridd.core.holdings import Holdings
from gridd.core.publication import ProviderPublisher
from gridd.core.readiness import Verdict, effective_stale_after_s, measured_pass_s
from gridd.core.transitions import TransitionLog
from gridd.credentials import credentials_for
from gridd.errors import StateError
from gridd.http.serve import serve_asgi
from gridd.link.dial import ExpectedPeer, open_channel_dialer
from gridd.link.poller import PollLink
from gridd.link.serve import serve_channel
from gridd.operator.channel_setup import (
    ChannelMetrics,
    OperatorTLS,
    channel_limits,
    check_channel_config,
    load_operator_tls,
)
from gridd.operator.exporter import ProbeCollector, ProviderCollector
from gridd.operator.gateway_feedback import GatewayFeedbackIntake
from gridd.operator.peers import PeerSupervisor
from gridd.operator.relay import RelayEndpoint
from gridd.operator.scrape import (
    Client,
    ScrapePool,
    ScrapeResult,
    ScrapeTarget,
    make_client,
    make_scrape_client,
)
from gridd.probes.runner import ProbeRunner
from gridd.probes.sinks import RunIO, check_sink_paths
from gridd.reload_plan import plan_reload
from gridd.roles import StagedReload
from gridd.state import API_TOKEN_FILE, EpochClaim, ProviderRevision, StateDir, plan_revisions
from gridd.tls import PeerIdentity
from gridd.wire import FeedbackAck, FeedbackReport

log = logging.getLogger("gridd.operator")

class StagedOperator(msgspec.Struct, frozen=True):
    loaded: LoadedConfig
    revisions: dict[str, ProviderRevision]
    tls: OperatorTLS | None = None


def check_operator_config(loaded: LoadedConfig) -> None:
    """What an operator's config must meet beyond decoding, at start and at every reload (and
    in ``gridd check-config``); ConfigError names the path."""
    check_channel_config(loaded.config)
    check_sink_paths(loaded)
    check_api_exposure(loaded.config)


def probe_only(provider: ProviderConfig) -> bool:
    """An enabled provider with no ``metrics`` block and at least one enabled probe: published
    every scrape interval from its probes alone (spec 004 Example 1)."""
    return (provider.enabled and provider.metrics is None
            and any(probe.enabled for probe in provider.settings.probes))


def scrape_target(provider: ProviderConfig) -> ScrapeTarget | None:
    source = provider.metrics
    if source is None or not provider.enabled:
        return None
    # An EPP's /metrics wants a bearer token by default (--metrics-endpoint-auth): give it its
    # own metrics.auth. The provider's key goes only to its own origin (docs/security.md).
    headers = credentials_for(source.url, source.auth, provider)
    return ScrapeTarget(provider.name, source.url, source.timeout_s, headers)


class OperatorService:
    def __init__(
        self,
        loaded: LoadedConfig,
        registry: CollectorRegistry,
        *,
        wall: Callable[[], float] = wall_clock,
        client: Client | None = None,
        rng: random.Random | None = None,
        open_peer_link: Callable[[PeerConfig], AbstractAsyncContextManager[PollLink]] | None = None,
        probe_client: httpx.AsyncClient | None = None,
        pass_observer: Callable[[float, float], None] | None = None,
        probe_io: RunIO = trio.to_thread.run_sync,
        state_io: RunIO = trio.to_thread.run_sync,
    ) -> None:
        self.loaded = loaded
        # The scrape targets of one committed provider list (see _targets).
        self._scrape_targets: tuple[object, list[ScrapeTarget]] = (None, [])
        self.registry = registry
        self.wall = wall
        self._client = client
        # Told (start, duration) after each scrape pass, once the pass's own work is done
        # (benchmarks/scale.py marks its CPU samples with it).
        self._pass_observer = pass_observer
        self._probe_client = probe_client
        self.state = StateDir(loaded.resolve(loaded.config.state_dir))
        self.holdings = Holdings()
        self.fences = AdmissionFences(future_epoch_bound_s=loaded.config.timings.future_epoch_bound_s)
        self.publishers: dict[str, ProviderPublisher] = {}
        # The provider revisions last committed (and written to the state directory).
        self.revisions: dict[str, ProviderRevision] = {}
        self._providers_by_name: dict[str, ProviderConfig] = {}
        self.publisher_epoch: int | None = None
        self._epoch_lock = trio.Lock()
        self._epoch_claim_failing = False
        self._epoch_clock_resets = Counter(
            "grid_operator_publisher_epoch_clock_resets",
            "Publisher epochs restarted from the wall clock because the previous one was more than "
            "future_epoch_bound_s ahead of it (a clock that ran ahead and was corrected).",
            registry=registry)
        # One sequence for every batch this operator publishes in its epoch: strictly
        # increasing per provider even across a delete and re-create (see publication.py).
        self._sequence = itertools.count(1)
        self.pool: ScrapePool | None = None
        self.tls: OperatorTLS | None = None
        # One line per transition of each provider's scrape and readiness, rate-limited per
        # target (gridd/core/transitions.py); kept across reloads like the publishers.
        self.transitions = TransitionLog()
        self._rng = rng if rng is not None else random.Random()
        self._draining = False
        self.signals_metrics = ChannelMetrics(registry)
        self.signals_address: str | None = None
        # Runs blocking state-directory IO off the event loop (tests on a MockClock pass one
        # that stays on it, so virtual time does not leap while a thread runs).
        self._state_io = state_io
        self.feedback = GatewayFeedbackIntake(self.state.path, registry, wall=wall, state_io=state_io)
        self.endpoint = RelayEndpoint(config=lambda: self.config, holdings=self.holdings,
                                        metrics=self.signals_metrics, wall=wall, feedback=self.take_feedback)
        self.peers = PeerSupervisor(own_site=loaded.config.site, fences=self.fences, holdings=self.holdings,
                                    timings=lambda: self.config.timings, wall=wall,
                                    open_link=open_peer_link or self._open_peer_link,
                                    limits=lambda: self.config.limits)
        registry.register(ProviderCollector(
            self.holdings,
            lambda: list(self.publishers.values()),
            trio.current_time,
            lambda: self.pool.last_pass_s if self.pool is not None else None,
            self.fences.drops,
            own_site=loaded.config.site,
            signal_ttl_s=lambda: self.config.timings.signal_ttl_s,
            own_verdict=self._current_verdict,
            stale_after_s=self._stale_after_s,
        ))
        # Probes (spec 004) get their own HTTP pool and limiter, sized like the scrape pool's,
        # so they never queue inside the scrape client's pool (STYLE 8).
        self.probes = ProbeRunner(publisher=self.publishers.get,
                                  resolve=lambda path: self.loaded.resolve(path),
                                  body_cap=lambda: self.config.timings.body_cap_bytes, wall=wall,
                                  concurrency=loaded.config.timings.scrape_concurrency, run_io=probe_io)
        registry.register(ProbeCollector(self.probes.snapshot, own_site=loaded.config.site))
        # The providers API (docs/providers-api.md) on listen.http; its mutations go through
        # the daemon's staged reload, attached by the daemon (attach_reload).
        self._reload: StagedReload | None = None
        self.api_token: str | None = None
        self.api = ProvidersAPI(loaded=lambda: self.loaded, reload=self._reload_for_api,
                                write_token=lambda: self.api_token)
        self.api_urls: list[str] = []
        self._api_stop = trio.Event()
        self._api_done = trio.Event()

    @property
    def config(self) -> Config:
        return self.loaded.config

    def attach_reload(self, reload: StagedReload) -> None:
        """The daemon's staged reload (the one SIGHUP runs), for the providers API."""
        self._reload = reload

    async def _reload_for_api(self) -> Mapping[str, Any]:
        if self._reload is None:
            return {"result": "error", "error": "no daemon is attached to reload this operator"}
        return await self._reload(source="providers API")

    async def _serve_api(self, *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
        assert self.config.listen.http is not None
        try:
            await serve_asgi(self.api, [self.config.listen.http], stop_accepting=self._api_stop,
                             task_status=task_status, **http_limits(self.config))
        finally:
            self._api_done.set()

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        # TLS first: bad material is a start-up error (the daemon prints it, exits 1).
        check_operator_config(self.loaded)
        self.tls = await trio.to_thread.run_sync(load_operator_tls, self.loaded, self.wall())
        if self.config.listen.http is not None:
            # Writes always need a token: this one (docs/security.md), read by gridctl.
            self.api_token = await trio.to_thread.run_sync(self.state.api_token)
        # DESIGN 5: the publisher epoch is written durably before the first publication.
        claim = await trio.to_thread.run_sync(partial(
            self.state.claim_publisher_epoch, self.wall(),
            future_bound_s=self.config.timings.future_epoch_bound_s))
        self._adopt_epoch(claim)
        self.revisions = await trio.to_thread.run_sync(self.state.sync_providers, self.config.providers)
        self._apply_providers(self.revisions)
        await self.load_gateway_evidence()
        log.info("publisher epoch %d; %d providers", self.publisher_epoch, len(self.publishers))
        timings = self.config.timings
        # The lean HTTP/1.1 client (operator/http1.py; docs/scaling.md): a third of httpx's CPU.
        client = self._client or make_scrape_client()
        probe_client = self._probe_client or make_client(timings.scrape_concurrency)
        async with AsyncExitStack() as clients, trio.open_nursery() as nursery:
            await clients.enter_async_context(client)
            await clients.enter_async_context(probe_client)
            self.pool = ScrapePool(client, concurrency=timings.scrape_concurrency,
                                   body_cap=timings.body_cap_bytes, on_result=self._on_scrape,
                                   on_pass=self._pass_done)
            await nursery.start(self.pool.run, lambda: self.config.timings.scrape_interval_s,
                                self._targets, name="scrape-pool")
            await nursery.start(self.probes.run, probe_client, self.config.providers, name="probe-runner")
            cfg = self.config
            if self.tls is not None and cfg.listen.signals is not None:
                self.signals_address = await nursery.start(
                    partial(serve_channel, cfg.listen.signals, self.server_context, self.endpoint.handle,
                            limits=lambda: channel_limits(self.config.timings),
                            on_refused=self.signals_metrics.count_refused),
                    name="signals-server",
                )
                log.info("signals channel listening on %s", self.signals_address)
            if self.tls is not None:
                await nursery.start(self.peers.run, cfg.peers, name="peer-pollers")
            if cfg.listen.http is not None:
                self.api_urls = await nursery.start(self._serve_api, name="providers-api")
                log.info("providers API listening on %s", ", ".join(self.api_urls))
            task_status.started()

    # -- gateway feedback ----------------------------------------------------------------

    @property
    def gateway_evidence(self) -> GatewayEvidenceLedger:
        return self.feedback.ledger

    async def load_gateway_evidence(self) -> None:
        await self.feedback.load()

    async def take_feedback(self, identity: PeerIdentity, report: FeedbackReport) -> FeedbackAck:
        return await self.feedback.take(identity, report)

    async def clear_gateway_evidence(self, replica: str | None) -> list[str]:
        """gridctl clear-feedback (gridd.roles.ClearsGatewayEvidence)."""
        return await self.feedback.clear(replica)

    def server_context(self) -> ssl.SSLContext:
        """The TLS context new channel connections are served with (a rotation swaps it)."""
        assert self.tls is not None
        return self.tls.material.server_context

    def _open_peer_link(self, peer: PeerConfig) -> AbstractAsyncContextManager[PollLink]:
        # The TLS material current when the poller (re)starts; a rotation restarts it.
        assert self.tls is not None
        expected = ExpectedPeer(self.config.trust_domain, peer.site, "operator")
        return open_channel_dialer(peer.url, self.tls.material.client_context, expected, rng=self._rng)

    def _targets(self) -> list[ScrapeTarget]:
        if self._draining:
            return []
        # Built once per committed config, not per pass: each target parses its URL's origin
        # for the credentials rule (about 10% of the operator's CPU at 1000 providers).
        providers = self.config.providers
        if self._scrape_targets[0] is not providers:
            self._scrape_targets = (providers,
                                    [t for p in providers if (t := scrape_target(p)) is not None])
        return self._scrape_targets[1]

    def _stale_after_s(self) -> float:
        t = self.config.timings
        pool = self.pool
        # The readiness floor (one interval + max(interval, latest measured pass)) overrides
        # staleMetricsSeconds when longer (spec: Provider Readiness). The pass still running
        # counts as soon as it has run longer than the last finished one.
        last_pass = (measured_pass_s(pool.last_pass_s, pool.pass_started_at, trio.current_time())
                     if pool else 0.0)
        return effective_stale_after_s(t.effective_stale_metrics_s, t.scrape_interval_s, last_pass)

    def _current_verdict(self, publisher: ProviderPublisher) -> Verdict:
        provider = self._providers_by_name.get(publisher.provider)
        return publisher.current_verdict(trio.current_time(), stale_after_s=self._stale_after_s(),
                                         unavailable=provider is not None and provider.unavailable)

    # -- publisher epoch -------------------------------------------------------------------

    def _adopt_epoch(self, claim: EpochClaim) -> None:
        self.publisher_epoch = claim.epoch
        for publisher in self.publishers.values():
            publisher.publisher_epoch = claim.epoch
        if claim.discarded is not None:
            self._epoch_clock_resets.inc()
            log.warning("publisher epoch %d was %d s ahead of the wall clock, beyond the %g s skew bound "
                        "receivers apply: restarted the epoch from the clock at %d", claim.discarded,
                        claim.discarded - int(self.wall()), self.config.timings.future_epoch_bound_s,
                        claim.epoch)

    def _epoch_beyond_clock(self, wall_now: float | None = None) -> bool:
        """Whether the publisher epoch is past the skew bound of the wall clock (read now,
        unless the caller has just read it: ``wall_now``)."""
        epoch = self.publisher_epoch
        if epoch is None:
            return False
        if wall_now is None:
            wall_now = self.wall()
        return epoch > wall_now + self.config.timings.future_epoch_bound_s

    async def _reclaim_epoch(self) -> None:
        """The wall clock stepped back while running, so far that every receiver whose clock
        agrees drops this epoch as skew: claim a new one from the clock (durably, before
        anything is published under it) instead of publishing into a lock-out."""
        async with self._epoch_lock:
            if not self._epoch_beyond_clock():
                return  # claimed meanwhile, for another provider's result
            try:
                claim = await self._state_io(partial(
                    self.state.claim_publisher_epoch, self.wall(),
                    future_bound_s=self.config.timings.future_epoch_bound_s))
            except StateError as exc:
                if not self._epoch_claim_failing:
                    log.error("publisher epoch is beyond the skew bound, but a new one cannot be claimed: %s",
                              exc)
                self._epoch_claim_failing = True
                return
            self._epoch_claim_failing = False
            self._adopt_epoch(claim)

    def _on_scrape(self, result: ScrapeResult) -> Awaitable[None] | None:
        """The pool's result handler (the pool hands results on in rounds, at most one every
        HAND_ON_EVERY_S, gridd/operator/scrape.py). It waits for nothing unless a new
        publisher epoch must be claimed first: then it returns what to wait for (the later
        results wait, the scrapes go on), else it publishes at once and returns None."""
        wall_now = self.wall()
        if self._epoch_beyond_clock(wall_now):
            return self._reclaim_epoch_then_publish(result)
        self._publish_scrape(result, wall_now)
        return None

    async def _reclaim_epoch_then_publish(self, result: ScrapeResult) -> None:
        await self._reclaim_epoch()
        self._publish_scrape(result, self.wall())

    def _publish_scrape(self, result: ScrapeResult, wall_now: float) -> None:
        """``wall_now``: the wall clock read just before (one read serves the epoch check
        and the batch when no claim came between)."""
        publisher = self.publishers.get(result.provider)
        provider = self._providers_by_name.get(result.provider)
        if publisher is None or provider is None:
            return  # removed by a reload while its scrape ran
        batch = publisher.on_scrape(
            now=result.finished_at,
            wall_now=wall_now,
            body=result.body,
            failure_class=result.failure_class,
            failure_detail=result.detail,
            stale_after_s=self._stale_after_s(),
            unavailable=provider.unavailable,
        )
        self._log_transitions(publisher, result.finished_at)
        summary = publisher.summary
        if publisher.invalid_fields_changed:
            # Once per transition, not per scrape: which fields are left out, and why.
            if summary.invalid_fields:
                log.warning("provider %s: reading published without %s: %s", result.provider,
                            ", ".join(summary.invalid_fields),
                            "; ".join(f"{field}: {why}" for field, why in summary.invalid_fields.items()))
            else:
                log.info("provider %s: every field of the reading is valid again", result.provider)
        self.holdings.hold(batch, result.finished_at)

    def _pass_done(self, started: float, duration: float) -> None:
        self._publish_probe_only(started, duration)
        if self._pass_observer is not None:
            self._pass_observer(started, duration)

    def _publish_probe_only(self, started: float, duration: float) -> None:
        """After each scrape pass (so every scrape interval): one batch per probe-only
        provider, carrying its probe metadata (spec 004 Example 1: such a provider is
        listed and routable; without this nothing would ever publish it)."""
        if self._draining:
            return
        now = trio.current_time()
        for provider in self.config.providers:
            publisher = self.publishers.get(provider.name)
            if publisher is None or not probe_only(provider):
                continue
            batch = publisher.on_probe_only(now=now, wall_now=self.wall(), unavailable=provider.unavailable)
            self._log_transitions(publisher, now)
            self.holdings.hold(batch, now)

    def _log_transitions(self, publisher: ProviderPublisher, now: float) -> None:
        """Scrape failing/recovered (with the failure class) and ready/not-ready (with the
        reason): one line per change, never one per scrape."""
        name, summary = publisher.provider, publisher.summary
        failing = summary.last_failure_class
        scrape = "ok" if failing is None else f"failing ({failing})"
        if (line := self.transitions.observe(("scrape", name), scrape, now, baseline="ok")) is not None:
            if failing is not None:
                log.warning("provider %s: scrape %s: %s%s", name, scrape, summary.last_failure_detail,
                            line.suffix())
            else:
                was = f", was {line.old}" if line.old not in (None, "ok") else ""
                log.info("provider %s: scrape recovered%s%s", name, was, line.suffix())
        verdict = publisher.last_verdict
        if verdict is None:
            return
        ready = {True: "ready", False: "not ready", None: "readiness unknown"}[verdict.ready]
        state = f"{ready} ({verdict.reason})"
        if (line := self.transitions.observe(("ready", name), state, now)) is not None:
            message = f": {verdict.message}" if verdict.message else ""
            log.log(logging.WARNING if verdict.ready is False else logging.INFO, "provider %s: %s%s%s",
                    name, state, message, line.suffix())

    def _apply_providers(self, revisions: dict[str, ProviderRevision]) -> None:
        cfg = self.config
        self._providers_by_name = {p.name: p for p in cfg.providers}
        now = trio.current_time()
        for name in [n for n in self.publishers if n not in revisions]:
            del self.publishers[name]
            self.transitions.forget(("scrape", name))
            self.transitions.forget(("ready", name))
            # Removed from the config: gateways are told, and answer 404 within one poll.
            self.holdings.remove(cfg.site, name, now)
        for provider in cfg.providers:
            if scrape_target(provider) is None and not probe_only(provider):
                # Disabled (or nothing to scrape, no probe): nothing current to publish or relay.
                self.holdings.forget(cfg.site, provider.name)
        t = cfg.timings
        for provider in cfg.providers:
            rev = revisions[provider.name]
            source = provider.metrics
            pool = source.pool if source else None
            queue_full_at = source.queue_full_at if source else None
            kind = source.kind if source else "auto"
            adapters = tuple(source.adapters) if source else ()
            existing = self.publishers.get(provider.name)
            if existing is None:
                self.publishers[provider.name] = ProviderPublisher(
                    site=cfg.site, provider=provider.name, model=provider.model, provider_uid=rev.uid,
                    generation=rev.generation, publisher_epoch=self.publisher_epoch or 0, created_at=now,
                    next_sequence=self._sequence.__next__, pool=pool, queue_full_at=queue_full_at, kind=kind,
                    adapters=adapters, latency_window_s=t.latency_window_s,
                    latency_min_completed=t.latency_min_completed,
                    engine_answer_window_s=t.engine_answer_window_s, metrics_source=source is not None,
                )
            else:
                existing.reconfigure(model=provider.model, provider_uid=rev.uid, generation=rev.generation,
                                     pool=pool, queue_full_at=queue_full_at, kind=kind, adapters=adapters,
                                     metrics_source=source is not None)
                existing.retune(latency_window_s=t.latency_window_s,
                                latency_min_completed=t.latency_min_completed,
                                engine_answer_window_s=t.engine_answer_window_s)

    async def stage(self, new: LoadedConfig) -> StagedOperator:
        check_operator_config(new)
        plan_reload(self.config, new.config).refuse_restart_changes("operator")
        # A bad certificate/key/CA rejects the reload; the old material keeps serving.
        tls = await trio.to_thread.run_sync(load_operator_tls, new, self.wall())
        # Staging changes nothing durable: the revisions are planned from the committed ones
        # and written by commit(), so a rejected reload leaves the state directory as it was.
        revisions = plan_revisions(self.revisions, new.config.providers)
        return StagedOperator(new, revisions, tls)

    def commit(self, staged: StagedOperator) -> None:
        """Swap the staged config in. The changed provider revisions are written first
        (one small file, replaced atomically): if that fails, StateError rejects the reload
        before anything was swapped, and the file on disk is the old one."""
        if staged.revisions != self.revisions:
            self.state.write_revisions(staged.revisions)
        self.revisions = staged.revisions
        old = self.config
        self.loaded = staged.loaded
        t = self.config.timings
        self.fences.future_epoch_bound_s = t.future_epoch_bound_s
        if self.pool is not None:
            self.pool.body_cap = t.body_cap_bytes
        self._apply_providers(staged.revisions)
        if self.probes.running and not self._draining:
            # Only probes whose spec changed restart; the rest keep their schedule and window.
            # A commit must not stop half-way (staging validated the probes; this is the
            # backstop), so the peer and TLS updates below always happen.
            try:
                changes = self.probes.update(self.config.providers)
            except Exception:
                log.exception("probes could not be updated for the committed config")
                changes = {}
            for what, keys in changes.items():
                if keys:
                    log.info("probes %s: %s", what, ", ".join(f"{p}/{n}" for p, n in keys))
        # New connections use the new contexts (the server reads them per connection);
        # pollers restart only when the material or the trust domain changed.
        rotated = (staged.tls is not None and self.tls is not None
                   and staged.tls.files_sha256 != self.tls.files_sha256)
        restart_all = rotated or old.trust_domain != self.config.trust_domain
        self.tls = staged.tls
        if self.peers.running:
            started = self.peers.update(self.config.peers, restart_all=restart_all)
            if started:
                log.info("peer pollers (re)started: %s", ", ".join(site for site, _ in started))

    async def drain(self) -> None:
        # Stop producing: the next pass scrapes nothing. Peers and gateways keep polling
        # what we hold until the daemon's deadline ends the process.
        self._draining = True
        self.probes.stop_all()
        # The providers API stops accepting; a mutation in flight finishes (its reload is
        # refused while draining, so it restores the file and answers 409).
        self._api_stop.set()
        if self.api_urls:
            await self._api_done.wait()

    def status(self) -> dict[str, Any]:
        now = trio.current_time()
        stale_after = self._stale_after_s()
        providers = []
        for provider in self.config.providers:
            pub = self.publishers.get(provider.name)
            if pub is None:
                continue
            verdict = pub.current_verdict(now, stale_after_s=stale_after, unavailable=provider.unavailable)
            load, latency, s = pub.last_load, pub.last_latency, pub.summary
            providers.append({
                "name": provider.name,
                "model": provider.model,
                "ready": verdict.ready,
                "reason": verdict.reason,
                "message": verdict.message,
                "ready_endpoints": load.ready_endpoints if load else None,
                "in_flight": load.in_flight if load else None,
                "kv_mean": load.kv_mean if load else None,
                "kv_spread": load.kv_spread if load else None,
                "latency": msgspec.to_builtins(latency) if latency else None,
                "scrape_age_s": None if s.last_scrape_at is None else round(now - s.last_scrape_at, 3),
                "failure_class": s.last_failure_class,
                "failure_detail": s.last_failure_detail,
                "invalid_fields": dict(s.invalid_fields),
                "provider_uid": pub.provider_uid,
                "generation": pub.generation,
                "batch_sequence": pub.sequence,
                "probes": self.probes.status(provider, now),
                # What the metadata sinks publish, as gateways receive it (spec 004: there is
                # no other read path but the file sink).
                "metadata": dict(pub.probes),
                "metadata_age_s": {k: round(now - at, 3) for k, at in pub.probes_at.items()},
            })
        return {
            "publisher_epoch": self.publisher_epoch,
            "stale_after_s": round(stale_after, 3),
            "last_pass_s": (None if self.pool is None or self.pool.last_pass_s is None
                            else round(self.pool.last_pass_s, 4)),
            "providers": providers,
            "held_readings": len(self.holdings),
            "signals": {
                "listen": self.signals_address,
                "connections": dict(self.endpoint.open_connections),
                "tls_not_after": None if self.tls is None else self.tls.material.not_after,
            },
            "peers": self.peers.status(),
            "providers_api": {
                "listen": self.api_urls,
                "auth": "bearer" if self.config.api.admin_token else "token for writes; loopback reads",
                "token_file": str(self.state.path / API_TOKEN_FILE) if self.api_token else None,
            },
            # Independent of peer diagnostics (spec): explains discarded signals, changes
            # no network phase and no routing.
            "gateway_feedback": self.feedback.status(),
        }
