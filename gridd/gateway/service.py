"""The gateway role (DESIGN.md 4): operator poller, scorer, OpenAI front and forwarder.

A gateway polls its own site's operator only while it is serving: the poller starts once
the front accepts requests and stops when the front starts draining (DESIGN 5b). Each
poll's answer goes into the pure store (gridd.core.store), which re-scores and swaps in
the per-model snapshots the request path reads. One connection, to its operator, so live
WAN connections are proportional to the operators, not to the gateways.
"""

from __future__ import annotations

import logging
import random
import secrets
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, aclosing
from typing import Any, Final

import httpx
import msgspec
import trio
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gridd.clock import wall_clock
from gridd.config import LoadedConfig, http_limits
from gridd.config_schema import Config
from gridd.core.cursors import held_cursors, unchanged_batches
from gridd.core.decisions import Decision
from gridd.core.explain import explain_model
from gridd.core.feedback import FAILURE_REASONS, Delivery, FeedbackReporter
from gridd.core.knobs import RoutingKnobs
from gridd.core.store import GatewayStore
from gridd.core.strategy import Strategy, StrategyTable
from gridd.core.transitions import TransitionLog
from gridd.errors import ConfigError
from gridd.gateway.front import make_front_app
from gridd.gateway.upstream_client import SwappableUpstream, close_expired_forever, make_upstream_client
from gridd.gateway.upstream_httpx import as_upstream
from gridd.gateway.upstream_request import Upstream
from gridd.http.asgi import ASGIApp
from gridd.http.serve import serve_asgi
from gridd.link.dial import ExpectedPeer, open_channel_dialer, parse_channel_url
from gridd.link.poller import LinkLines, PollAnswer, Poller, PollLink
from gridd.link.session import ChannelError
from gridd.link.supervisor import TaskSupervisor
from gridd.metrics_app import labelled_counter
from gridd.reload_plan import plan_reload
from gridd.tls import TLSMaterial, check_tls_material
from gridd.wire import PROTOCOL_VERSION, FeedbackAck, Poll

log = logging.getLogger("gridd.gateway")

# The key of the one supervised task of a gateway, and of its link in the transition log.
OPERATOR: Final = "operator"


class StagedGateway(msgspec.Struct, frozen=True):
    loaded: LoadedConfig
    tls: TLSMaterial | None


def check_gateway_config(cfg: Config) -> None:
    """What a gateway's config must meet beyond decoding, at start and at every reload (and in
    ``gridd check-config``): its one link to its operator is the signals channel, mutual TLS
    over ``wss://`` only. ConfigError names the path and the fix."""
    if cfg.tls is None:
        raise ConfigError("tls: a gateway needs its certificate to poll its operator over mutual TLS; "
                          "add tls: {ca, cert, key} (gridd certs issue --role gateway --replica R)")
    if cfg.operator is not None:
        try:
            parse_channel_url(cfg.operator.url)
        except ChannelError:
            raise ConfigError(f"operator.url: expected the operator's signals URL, wss://host:port/signals "
                              f"(its listen.signals), got {cfg.operator.url!r}") from None


def load_gateway_tls(loaded: LoadedConfig, wall: float) -> TLSMaterial | None:
    cfg = loaded.config
    if cfg.tls is None:
        return None
    return check_tls_material(
        str(loaded.resolve(cfg.tls.cert)), str(loaded.resolve(cfg.tls.key)), str(loaded.resolve(cfg.tls.ca)),
        now=wall, expected_site=cfg.site, expected_role="gateway", expected_trust_domain=cfg.trust_domain,
        expected_replica=cfg.replica,
    )


def store_knobs(cfg: Config) -> RoutingKnobs:
    t, r, shedding = cfg.timings, cfg.routing, cfg.availability.shedding
    return RoutingKnobs(
        signal_ttl_s=t.signal_ttl_s, future_epoch_bound_s=t.future_epoch_bound_s,
        capacity_floor=r.capacity_floor, rho_smoothing=r.rho_smoothing, recent_window_s=r.recent_window_s,
        unit_capacity=r.unit_capacity, evidence_window_s=r.evidence_window_s, pick_rule=r.pick_rule,
        pending_weight=r.pending_weight, candidate_retention_s=r.candidate_retention_s,
        shedding=shedding.enabled, full_after_s=shedding.full_after_ms / 1000,
        room_after_s=shedding.room_after_ms / 1000, strategies=strategy_table(cfg),
    )


def strategy_table(cfg: Config) -> StrategyTable:
    """``strategies`` with ``routing.strategy`` / ``routing.model_strategies`` (names checked
    by the config loader)."""
    by_name = {s.name: Strategy.of(s.name, s.provider_selector,
                                   [(k.provider_attribute, k.descending) for k in s.sort])
               for s in cfg.strategies}
    r = cfg.routing
    return StrategyTable(default=by_name.get(r.strategy) if r.strategy else None,
                         by_model={model: by_name[name] for model, name in r.model_strategies.items()},
                         pick_rule=r.strategy_pick_rule)


class StoreRouter:
    """The Router the front calls: the store's decision at trio's current time."""

    def __init__(self, store: GatewayStore, rng: random.Random, serving: Callable[[], bool]) -> None:
        self.store = store
        self.rng = rng
        self.site = store.site
        self._serving = serving
        self.had_routing_data = trio.Event()
        """Set at the first ingest that brought routing data (see the service's poll)."""

    async def first_routing_data(self) -> None:
        await self.had_routing_data.wait()

    def decide(self, model: str, *, pinned_site: str | None = None,
               exclude: frozenset[tuple[str, str]] = frozenset()) -> Decision:
        return self.store.decide(model, now=trio.current_time(), rng=self.rng, pinned_site=pinned_site,
                                 exclude=exclude)

    def models(self) -> list[str]:
        return self.store.models()

    def ready(self) -> bool:
        return self.not_ready_reason() is None

    def not_ready_reason(self) -> str | None:
        if not self._serving():
            return "not serving (starting or draining)"
        return self.store.routing_data_problem(trio.current_time())


class GatewayCollector(Collector):
    def __init__(self, service: GatewayService) -> None:
        self.service = service

    def describe(self):
        return []

    def collect(self):
        svc = self.service
        yield labelled_counter("grid_signals_ingest_dropped", "Batches not admitted, by reason.",
                               ["reason"], sorted(svc.store.fences.drops().items()))
        yield labelled_counter("grid_gateway_polls", "Polls of the local operator by result.",
                               ["result"], sorted(svc.poll_results.items()))
        now = trio.current_time()
        labels = ["grid_site", "grid_provider", "model"]
        rho = GaugeMetricFamily("grid_gateway_candidate_rho", "Recent worst saturation of a candidate.",
                                labels=labels)
        capacity = GaugeMetricFamily("grid_gateway_candidate_capacity", "Learned capacity bound (requests).",
                                     labels=labels)
        age = GaugeMetricFamily("grid_gateway_candidate_age_seconds", "Age of the candidate's reading.",
                                labels=labels)
        for cand in svc.store.candidates.values():
            key = [cand.site, cand.provider, cand.model]
            worst = cand.learner.recent_worst_rho(now)
            if worst is not None:
                rho.add_metric(key, worst)
            capacity.add_metric(key, cand.learner.bound)
            age.add_metric(key, cand.age_s(now))
        yield from (rho, capacity, age)
        shedding = GaugeMetricFamily("grid_gateway_model_shedding", "1 while the model sheds (429).",
                                     labels=["model"])
        for model, shed in svc.store.shed.items():
            shedding.add_metric([model], 1.0 if svc.store.shedding_enabled and shed.shedding(now) else 0.0)
        yield shedding
        reporter = svc.reporter
        # Spec: "report contents never become metric labels": reasons only.
        failures = CounterMetricFamily("grid_signals_feedback_failures",
                                       "Failed feedback report deliveries to the local operator, by reason.",
                                       labels=["reason"])
        for failure in FAILURE_REASONS:
            failures.add_metric([failure], reporter.failures[failure])
        yield failures
        yield CounterMetricFamily("grid_signals_feedback_delivered",
                                  "Feedback reports the local operator acknowledged as accepted.",
                                  value=reporter.delivered)
        yield GaugeMetricFamily("grid_signals_feedback_pending_evidence",
                                "Skew-rejected batches not yet acknowledged by the local operator.",
                                value=reporter.pending_evidence)


class GatewayService:
    def __init__(
        self,
        loaded: LoadedConfig,
        registry: CollectorRegistry,
        *,
        wall: Callable[[], float] = wall_clock,
        rng: random.Random | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        ingress_transport: httpx.AsyncBaseTransport | None = None,
        open_operator_link: Callable[[], AbstractAsyncContextManager[PollLink]] | None = None,
        reporter_epoch: int | None = None,
    ) -> None:
        """open_operator_link: the connection to the operator (tests pass an in-memory one);
        by default a ChannelDialer over mutual TLS to ``operator.url``.
        reporter_epoch: the feedback reporter's process epoch; random (63 bits) by default."""
        self.loaded = loaded
        self.registry = registry
        self.wall = wall
        self.rng = rng or random.Random()
        # Injected transports (tests: httpx mock and ASGI transports) forward through upstream_httpx.
        self._transport = None if transport is None else as_upstream(transport)
        self._ingress_transport = None if ingress_transport is None else as_upstream(ingress_transport)
        self._open_operator_link = open_operator_link or self._dial_operator
        self.store = GatewayStore(site=loaded.config.site, knobs=store_knobs(loaded.config))
        self.router = StoreRouter(self.store, self.rng, lambda: self._serving)
        self.tls: TLSMaterial | None = None
        self._ingress: SwappableUpstream | None = None
        self.front_urls: list[str] = []
        # Polls of the operator by result, across poller restarts (grid_gateway_polls_total).
        self.poll_results: dict[str, int] = {"ok": 0}
        self.poller: Poller | None = None
        self.operator_state = "not polling"
        self.last_poll_error: str | None = None
        self._serving = False
        self._stop_accepting = trio.Event()
        self._front_done = trio.Event()
        # The operator poller, under its own cancel scope: restarted when a reload changes the
        # operator URL or the TLS material, stopped while draining; the store is never rebuilt.
        self._tasks: TaskSupervisor[str] = TaskSupervisor(
            restart_delay_s=lambda: self.config.timings.gateway_poll_interval_s, log=log)
        self._poller_restarts = 0
        # The skew-rejection reporter (spec: Gateway rejection reports). Its random process
        # epoch, sequence, cumulative count and pending evidence "survive committed poller
        # and certificate reloads": built once here, never by commit().
        self.reporter = FeedbackReporter(secrets.randbits(63) if reporter_epoch is None else reporter_epoch)
        self._feedback_failing: str | None = None
        self.link_transitions = TransitionLog()
        registry.register(GatewayCollector(self))

    @property
    def config(self) -> Config:
        return self.loaded.config

    @property
    def ingress(self) -> SwappableUpstream | None:
        """The upstream to other sites' ingress (its inner one swapped at a rotation)."""
        return self._ingress

    @property
    def poller_restarts(self) -> int:
        """Operator pollers a committed reload replaced (URL or TLS material changed)."""
        return self._poller_restarts

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        check_gateway_config(self.config)
        self.tls = await trio.to_thread.run_sync(load_gateway_tls, self.loaded, self.wall())
        assert self.tls is not None  # check_gateway_config refused a config without tls
        # Forwarding transports: this site's providers, and other sites' ingress (verified
        # against the grid CA, presenting this gateway's certificate, when it is https).
        transport: Upstream = self._transport or make_upstream_client()
        ingress = self._ingress = SwappableUpstream(
            self._ingress_transport or make_upstream_client(verify=self.tls.client_context))
        async with aclosing(transport), aclosing(ingress), trio.open_nursery() as nursery:
            if self.config.listen.http:
                app = make_front_app(self.router, transport, self.registry, rng=self.rng,
                                     ingress_transport=ingress)
                self.front_urls = await nursery.start(self._serve_front, app)
            else:
                self._front_done.set()  # no front: nothing to drain
            nursery.start_soon(close_expired_forever, (transport, ingress), name="upstream-keepalive")
            await nursery.start(self._tasks.run)
            # Serving from here on: the poller runs only while the front accepts requests.
            self._serving = True
            self._tasks.start(OPERATOR, self._poll_operator, label="operator poller")
            task_status.started()
            await self._stop_accepting.wait()
            await self._front_done.wait()
            nursery.cancel_scope.cancel()

    async def _serve_front(self, app: ASGIApp, *,
                           task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
        bind = self.config.listen.http
        if bind is None:  # check_gateway_config refuses a gateway without listen.http
            raise ConfigError("listen.http: a gateway needs an address for its front")
        try:
            await serve_asgi(app, [bind], stop_accepting=self._stop_accepting,
                             task_status=task_status, reuse_port=self.config.listen.http_reuse_port,
                             **http_limits(self.config))
        finally:
            self._front_done.set()

    def _dial_operator(self) -> AbstractAsyncContextManager[PollLink]:
        cfg = self.config
        assert cfg.operator is not None and self.tls is not None
        # The operator must be our own site's: its verified certificate names it.
        expected = ExpectedPeer(cfg.trust_domain, cfg.site, "operator")
        return open_channel_dialer(cfg.operator.url, self.tls.client_context, expected, rng=self.rng)

    async def _poll_operator(self) -> None:
        """One poller's life: a link to the operator, polled until the task is cancelled."""
        assert self.config.operator is not None  # the config loader requires it of a gateway
        url = self.config.operator.url
        poller = self.poller = Poller(
            target=OPERATOR,
            # The operator link: one line per change (up, down with the failure class, down
            # for another class), rate-limited (gridd/core/transitions.py), never one per poll.
            lines=LinkLines(log, up=f"operator {url}: link up, polling{{suffix}}",
                            down=f"operator {url}: link down, poll failed ({{reason}}): {{detail}}{{suffix}}",
                            timeout="no answer within {budget_s:g} s"),
            transitions=self.link_transitions,
            interval_s=lambda: self.config.timings.gateway_poll_interval_s,
            budget_s=lambda: self.config.timings.gateway_poll_budget_s,
            request=self._poll_request, admit=self._admit, on_failure=self._poll_failed,
            after_poll=self._after_poll, results=self.poll_results)
        async with self._open_operator_link() as link:
            self.operator_state = "connecting"
            await poller.run(link)

    def _poll_request(self) -> Poll:
        # Cursors: what this gateway holds, so the operator leaves out every batch
        # unchanged since (gridd/core/cursors.py; most of a 1 s poll's answer).
        cursors = held_cursors(self.store.candidates, self.store.fences)
        return Poll(protocol=PROTOCOL_VERSION, sent_wall=self.wall(), cursors=cursors)

    def _admit(self, answer: PollAnswer, now: float) -> None:
        if answer.serving is not None:
            self.store.set_serving(answer.serving)
        reply = answer.batches
        # The held batch of each unchanged provider is admitted as the repeat the re-sent
        # batch would have been (seen by this poll, age unchanged).
        repeated = unchanged_batches(self.store.candidates, reply.unchanged)
        self.store.ingest([*reply.batches, *repeated], now=now, now_wall=self.wall(),
                          removed=[(k.site, k.provider) for k in reply.removed])
        # Spec: "The reporter folds a committed observation before refresh and
        # cancellation, so replacing a poller during refresh cannot lose a genuine skew
        # drop." No checkpoint lies between the ingest and this fold, so no cancellation
        # can come between them.
        fences = self.store.fences
        self.reporter.observe(fences.drops()["skew"], fences.skew_evidence())
        if self.store.has_routing_data(now):
            self.router.had_routing_data.set()
        self.operator_state, self.last_poll_error = "up", None

    def _poll_failed(self, exc: ChannelError, now: float) -> None:
        self.operator_state, self.last_poll_error = "down", f"{exc.reason}: {exc}"
        # Readings keep ageing while the operator is unreachable: re-score so stale sites
        # sort last (loss of signal degrades to least preferred, not to idle).
        self.store.rebuild(now)

    async def _after_poll(self, link: PollLink, failed: bool) -> None:
        # Spec: "Failed fetches create no clean observation, but can retry pending bad
        # evidence." The poll's own result is settled before this: a failed report never
        # turns a successful poll into a failed one.
        await self._report_feedback(link, after_failed_fetch=failed)

    async def _report_feedback(self, link: PollLink, *, after_failed_fetch: bool) -> None:
        """Deliver the reporter's pending report, if any, in its own bounded exchange on the
        poller's connection (the dialer serializes exchanges). Spec: "Reporting has its own
        bounded exchange and does not turn a successful scrape into a failed scrape"."""
        report = self.reporter.next_report(after_failed_fetch=after_failed_fetch)
        if report is None:
            return  # spec: "a cycle with no pending report adds no failure"
        budget_s = self.config.timings.gateway_poll_budget_s
        outcome: Delivery | None = None
        with trio.move_on_after(budget_s):
            try:
                replies = await link.exchange(report)
            except ChannelError as exc:
                # Connection, TLS/identity, a refusal or a protocol error: "transport".
                outcome = self.reporter.on_failure("transport", f"{exc.reason}: {exc}")
            else:
                acks = [r for r in replies if isinstance(r, FeedbackAck)]
                outcome = self.reporter.on_ack(acks[0] if len(acks) == 1 else None)
        if outcome is None:
            outcome = self.reporter.on_failure("timeout", f"no acknowledgment within {budget_s:g} s")
        # Logged on a change only (failing, failing for another reason, delivered again).
        url = self.config.operator.url if self.config.operator is not None else None
        if outcome.failed and outcome.result != self._feedback_failing:
            log.warning("operator %s: feedback report %d not delivered (%s): %s", url,
                        report.sequence, outcome.result, outcome.detail)
        elif not outcome.failed and self._feedback_failing is not None:
            log.info("operator %s: feedback reports delivered again", url)
        self._feedback_failing = outcome.result if outcome.failed else None

    async def stage(self, new: LoadedConfig) -> StagedGateway:
        check_gateway_config(new.config)
        plan_reload(self.config, new.config).refuse_restart_changes("gateway")
        tls = await trio.to_thread.run_sync(load_gateway_tls, new, self.wall())
        return StagedGateway(new, tls)

    def commit(self, staged: StagedGateway) -> None:
        old = self.config
        self.loaded = staged.loaded
        self.store.reconfigure(store_knobs(self.config))
        # A rotation (new certificate, key or CA bundle: gridd.tls.tls_files_digest) restarts
        # the poller and swaps the ingress transport.
        restart = staged.tls is not None and (self.tls is None
                                              or staged.tls.files_sha256 != self.tls.files_sha256)
        self.tls = staged.tls
        if restart and self._ingress is not None and staged.tls is not None:
            # Other sites' ingress: new connections present the rotated certificate.
            self._ingress.swap(make_upstream_client(verify=staged.tls.client_context))
        if restart or old.operator != self.config.operator:
            self._poller_restarts += 1
            self._tasks.restart(OPERATOR)
            log.info("operator poller restarted for the new config")

    async def drain(self) -> None:
        """Stop accepting, stop polling (a draining gateway holds no poll), let in-flight
        requests finish; the daemon bounds this with drain_grace_s."""
        self._serving = False
        self._tasks.stop(OPERATOR)
        self.operator_state = "not polling (draining)"
        self._stop_accepting.set()
        await self._front_done.wait()

    def explain(self, model: str) -> dict[str, Any]:
        """gridctl explain MODEL: the store's view of the model at trio's current time."""
        return msgspec.to_builtins(explain_model(self.store, model, now=trio.current_time()))

    def status(self) -> dict[str, Any]:
        now = trio.current_time()
        store = self.store
        candidates = []
        for cand in sorted(store.candidates.values(), key=lambda c: (c.model, c.site, c.provider)):
            b = cand.batch
            state = store.candidate_state(cand, now)
            candidates.append({
                "model": cand.model, "site": cand.site, "provider": cand.provider,
                "age_s": round(state.age_s, 3), "signal": state.signal, "ready": b.ready if b else None,
                "excluded": state.excluded,
                # A reading past the TTL says nothing about now: no rho is shown for it.
                "rho": cand.learner.recent_worst_rho(now) if state.signal == "fresh" else None,
                "capacity": cand.learner.capacity(now),
                # Probe metadata as relayed (spec 004), with each value's age; a strategy
                # reads a value older than the signal TTL as missing.
                "metadata": dict(b.probes) if b else {},
                "metadata_age_s": {k: round(state.age_s + b.probe_age_s.get(k, 0.0), 3)
                                   for k in b.probes} if b else {},
            })
        return {
            # Serving but unable to route: status says "degraded" with this reason.
            "degraded": store.routing_data_problem(now) if self._serving else None,
            "operator": self.config.operator.url if self.config.operator else None,
            "operator_state": self.operator_state,
            "last_poll_error": self.last_poll_error,
            "front": self.front_urls,
            "serving": self._serving,
            "models": store.models(),
            # The strategy each model routes by (docs/strategies.md); absent: none.
            "strategies": {m: st.name for m in store.models()
                           if (st := store.knobs.strategies.for_model(m)) is not None},
            "shedding": sorted(m for m, s in store.shed.items()
                               if store.shedding_enabled and s.shedding(now)),
            "candidates": candidates,
            "ingest_drops": store.fences.drops(),
            "feedback": self.reporter.status(),
        }
