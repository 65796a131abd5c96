"""The operator's signals channel: who may connect and what each is sent, and the peer pollers.

Server side (``SignalsEndpoint.handle``, one call per authenticated connection):

    peer operator   another site's operator (same trust domain) listed in ``peers``:
                    Poll -> Batches with this operator's OWN site's batches only.
    own gateway     a gateway of this operator's own site:
                    Poll -> ServingConfig (first poll, then whenever it changed),
                            Batches with every site's batches;
                    FeedbackReport -> FeedbackAck from the feedback intake, keyed by
                            the gateway's verified replica (docs/feedback.md);
                            status="not_implemented" when the endpoint has none.
    anyone else     Error(reason="identity" | "forbidden"), then close.

    Authorization is by the verified certificate identity and is re-checked on every
    message, so a reload that removes a peer refuses its next poll on an open connection.
    Batches leave whole: revision metadata untouched, age increased by the holding time
    (gridd.core.holdings.Holdings.relay).

Peer pollers (``PeerSupervisor``): one task per configured peer, each under its own
cancel scope in a map keyed by the peer's (site, url) (STYLE 7). Every
peer_poll_interval_s, start to start (trio.sleep_until), one exchange bounded by
peer_poll_budget_s over a persistent connection (gridd.channel.SignalsDialer); each batch
passes the admission fences before it may touch the holdings. A reload restarts only the
pollers whose (site, url) changed, or all of them when the TLS material changed; the
holdings and fences are shared and never rebuilt.

docs/signals-channel.md is the long form, with every timeout.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, Final, Literal, Protocol

import msgspec
import trio
from prometheus_client import CollectorRegistry, Counter

from gridd.channel import ChannelError, ChannelLimits, SignalsSession, parse_signals_url
from gridd.config import LoadedConfig
from gridd.config_schema import Config, LimitsConfig, PeerConfig, TimingConfig
from gridd.core.admission import AdmissionFences, Outcome
from gridd.core.holdings import Holdings
from gridd.core.peer_intake import INTAKE_REFUSALS, NAME_MAX, PeerIntake
from gridd.core.transitions import TransitionLog
from gridd.errors import ConfigError
from gridd.tls import PeerIdentity, TLSMaterial, check_tls_material
from gridd.wire import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Batch,
    Batches,
    Error,
    FeedbackAck,
    FeedbackReport,
    LocalProvider,
    Message,
    Poll,
    ServingConfig,
    SiteIngress,
    SourceKey,
    WireEncodeError,
    encode,
    protocol_refusal,
)

log = logging.getLogger("gridd.operator.signals")

# grid_signals_connections_refused_total{reason}: the channel's own refusals (tls,
# handshake, identity before any message) and the operator's (identity, forbidden,
# protocol, decode after the WebSocket opened).
REFUSAL_REASONS: Final = ("tls", "handshake", "identity", "forbidden", "protocol", "decode")

# How often peer readings older than the signal TTL are dropped from the holdings, so a
# dead peer's series leave /metrics within TTL + this.
EXPIRE_EVERY_S: Final = 1.0
RELAY_RETENTION_TTLS = 2.0
"""A peer's reading is relayed (stale) until this many signal TTLs old, then forgotten."""
REFUSAL_LOG_EVERY_S = 60.0
"""A peer over its bounds (gridd.core.peer_intake) is logged at most this often."""

# The answer to a feedback report from an endpoint built without a feedback intake: a
# defined status that the gateway's reporter counts as not accepted (DESIGN 5b).
FEEDBACK_NOT_IMPLEMENTED: Final = "not_implemented"

# Takes one report from a verified gateway of this site and answers it (the operator's
# evidence ledger, gridd.operator.service.OperatorService.take_feedback).
FeedbackIntake = Callable[[PeerIdentity, FeedbackReport], Awaitable[FeedbackAck]]

PeerRole = Literal["peer", "gateway"]


# --- metrics ------------------------------------------------------------------------


class SignalsMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.refused = Counter(
            "grid_signals_connections_refused",
            "Signals-channel connections refused, by reason.",
            ["reason"],
            registry=registry,
        )
        for reason in REFUSAL_REASONS:
            self.refused.labels(reason)
        self.unsendable = Counter(
            "grid_signals_unsendable_batches",
            "Held batches left out of an answer because the wire could not carry them.",
            registry=registry,
        )

    def count_unsendable(self) -> None:
        self.unsendable.inc()

    def count_refused(self, reason: str) -> None:
        self.refused.labels(reason if reason in REFUSAL_REASONS else "protocol").inc()


# --- config checks and TLS material -------------------------------------------------


def check_signals_config(cfg: Config) -> None:
    """Rules of the signals channel a config must meet; ConfigError names the path."""
    if cfg.listen.signals is not None and cfg.tls is None:
        raise ConfigError("listen.signals: the signals channel is mutual TLS only; configure tls")
    if cfg.peers and cfg.tls is None:
        raise ConfigError("peers: polling peer operators needs tls (mutual TLS)")
    for i, peer in enumerate(cfg.peers):
        try:
            parse_signals_url(peer.url)
        except ChannelError:
            raise ConfigError(f"peers[{i}].url: expected a wss://host:port/path URL, got {peer.url!r}") from None


def channel_limits(timings: TimingConfig) -> ChannelLimits:
    """The server's per-connection policy: idle after 3x the longest poll interval."""
    longest = max(timings.peer_poll_interval_s, timings.gateway_poll_interval_s)
    return ChannelLimits(idle_s=3.0 * longest)


class SignalsTLS(msgspec.Struct, frozen=True):
    """Checked TLS material plus a digest of the three files, to tell a rotation apart."""

    material: TLSMaterial
    files_sha256: str


def load_signals_tls(loaded: LoadedConfig, now_wall: float) -> SignalsTLS | None:
    """Check the configured TLS material as an operator's (blocking; run in a thread)."""
    cfg = loaded.config
    if cfg.tls is None:
        return None
    cert, key, ca = (str(loaded.resolve(p)) for p in (cfg.tls.cert, cfg.tls.key, cfg.tls.ca))
    material = check_tls_material(cert, key, ca, now=now_wall, expected_site=cfg.site,
                                  expected_role="operator", expected_trust_domain=cfg.trust_domain)
    return SignalsTLS(material, material.files_sha256)


# --- server side --------------------------------------------------------------------


def serving_config_for(cfg: Config) -> ServingConfig:
    """What this operator's gateways need to forward: local providers and every ingress.

    Credentials: "bearer" carries api_key (the gateway sends Authorization: Bearer);
    "header" puts ``header_name: api_key`` into ``headers``, which the gateway sends
    verbatim along with the custom headers. Disabled providers are left out.
    """
    providers = []
    for p in cfg.providers:
        if not p.enabled:
            continue
        auth = p.settings.auth
        headers = dict(auth.custom_headers)
        api_key = None
        if auth.scheme == "bearer" and auth.api_key:
            api_key = auth.api_key
        elif auth.scheme == "header" and auth.api_key:
            headers[auth.header_name] = auth.api_key
        providers.append(LocalProvider(
            provider=p.name, model=p.model, endpoint_url=p.settings.endpoint, auth_scheme=auth.scheme,
            api_key=api_key, headers=headers, timeout_s=p.settings.timeout,
        ))
    ingresses = [SiteIngress(peer.site, peer.ingress) for peer in cfg.peers if peer.ingress]
    if cfg.ingress:
        ingresses.append(SiteIngress(cfg.site, cfg.ingress))
    return ServingConfig(providers=tuple(providers), ingresses=tuple(ingresses))


def classify(identity: PeerIdentity, cfg: Config) -> PeerRole | Error:
    """Who a verified client is to this operator, or the Error that refuses it.

    Decided: an operator of a site not listed in ``peers`` is refused (forbidden): a
    site's batches go only to the peers its operator was configured to trust, and the
    relationship is mutual by configuration. So is an operator naming this operator's own
    site (a twin or a stolen name; never a peer) and a gateway of any other site (DESIGN 2:
    gateways talk only to their own site's operator; local credentials stay local).
    """
    if identity.trust_domain != cfg.trust_domain:
        return Error("identity", f"{identity.uri} is outside trust domain {cfg.trust_domain!r}")
    if identity.role == "gateway":
        if identity.site == cfg.site:
            return "gateway"
        return Error("forbidden", f"gateway of site {identity.site!r} may only poll its own site's operator")
    if identity.site == cfg.site:
        return Error("forbidden", f"operator of this operator's own site {cfg.site!r} is not a peer")
    if all(peer.site != identity.site for peer in cfg.peers):
        return Error("forbidden", f"site {identity.site!r} is not a configured peer of site {cfg.site!r}")
    return "peer"


class SignalsEndpoint:
    """The handler serve_signals runs for every connection to this operator."""

    def __init__(
        self,
        *,
        config: Callable[[], Config],
        holdings: Holdings,
        metrics: SignalsMetrics,
        wall: Callable[[], float],
        feedback: FeedbackIntake | None = None,
    ) -> None:
        self.config = config
        self.holdings = holdings
        self.metrics = metrics
        self.wall = wall
        self.feedback = feedback
        self.open_connections: dict[PeerRole, int] = {"peer": 0, "gateway": 0}

    def _encodable(self, answer: Batches, exc: WireEncodeError) -> Batches:
        keep: list[Batch] = []
        size = 0
        for batch in answer.batches:
            try:
                size += len(encode(msgspec.structs.replace(answer, batches=(batch,), unchanged=())))
            except WireEncodeError:
                self.metrics.count_unsendable()
                continue
            if size > MAX_FRAME_BYTES // 2:
                self.metrics.count_unsendable()
                continue
            keep.append(batch)
        log.error("signals: answer could not be encoded whole (%s); sending %d of %d batches",
                  exc, len(keep), len(answer.batches))
        return msgspec.structs.replace(answer, batches=tuple(keep))

    async def _refuse(self, session: SignalsSession, error: Error, *, counted_as: str | None = None) -> None:
        reason = counted_as or error.reason
        log.info("signals: refusing %s (%s): %s", session.where, reason, error.detail)
        self.metrics.count_refused(reason)
        try:
            await session.send(error)
        except ChannelError:
            pass  # gone already; the refusal is counted either way

    async def handle(self, session: SignalsSession) -> None:
        verdict = classify(session.identity, self.config())
        if isinstance(verdict, Error):
            await self._refuse(session, verdict)
            return
        role: PeerRole = verdict
        self.open_connections[role] += 1
        try:
            await self._serve(session, role)
        except ChannelError as exc:
            # The client went away mid-reply; nothing to answer.
            log.debug("signals: %s: %s", session.where, exc)
        finally:
            self.open_connections[role] -= 1

    async def _serve(self, session: SignalsSession, role: PeerRole) -> None:
        sent_config: ServingConfig | None = None
        while True:
            try:
                msg: Message = await session.receive()
            except ChannelError as exc:
                if exc.reason == "decode":
                    await self._refuse(session, Error("decode", str(exc)))
                return  # closed or lost: the client dials again when it wants to
            cfg = self.config()
            # Re-checked per message: a committed reload may have removed this peer.
            verdict = classify(session.identity, cfg)
            if isinstance(verdict, Error):
                await self._refuse(session, verdict)
                return
            match msg:
                case Poll(protocol=protocol, cursors=cursors):
                    refusal = protocol_refusal(protocol)
                    if refusal is not None:
                        await self._refuse(session, refusal)
                        return
                    now = trio.current_time()
                    if role == "gateway":
                        serving = serving_config_for(cfg)
                        if serving != sent_config:
                            await session.send(serving)
                            sent_config = serving
                        batches, unchanged = self.holdings.relay_since(now, cursors)
                        removed = self.holdings.removed(now, cfg.routing.candidate_retention_s)
                    else:
                        # A peer operator gets only this site's own batches: it polls
                        # every other site directly and attributes each to its identity.
                        batches, unchanged = self.holdings.relay_since(now, cursors, site=cfg.site)
                        removed = self.holdings.removed(now, cfg.routing.candidate_retention_s, site=cfg.site)
                    answer = Batches(protocol=PROTOCOL_VERSION, sent_wall=self.wall(),
                                     batches=batches, unchanged=unchanged, removed=removed)
                    try:
                        frame_ok = encode(answer)
                    except WireEncodeError as exc:
                        # One batch the wire cannot carry (or too many for one frame) must not
                        # blind every poller: send what encodes, count and log the rest.
                        answer = self._encodable(answer, exc)
                        frame_ok = None
                    if frame_ok is None:
                        await session.send(answer)
                    else:
                        await session.send_frame(frame_ok)
                case FeedbackReport(reporter_epoch=epoch, sequence=sequence) if role == "gateway":
                    # Spec: "Feedback is scoped to the verified local operator identity":
                    # classify() let only this site's gateways this far, and the intake
                    # keys what it keeps by the replica their certificate names.
                    if self.feedback is None:
                        ack = FeedbackAck(reporter_epoch=epoch, sequence=sequence, status=FEEDBACK_NOT_IMPLEMENTED,
                                          detail="this operator does not take feedback reports yet")
                    else:
                        ack = await self.feedback(session.identity, msg)
                    await session.send(ack)
                case FeedbackReport():
                    await self._refuse(session, Error("forbidden", "only this site's gateways send feedback"))
                    return
                case _:
                    await self._refuse(session, Error("unexpected", f"{type(msg).__name__} is not a request"),
                                       counted_as="protocol")
                    return


# --- peer pollers -------------------------------------------------------------------


class PeerLink(Protocol):
    """What a poller needs from its connection (gridd.channel.SignalsDialer in the daemon)."""

    identity: PeerIdentity | None
    connections_opened: int

    async def exchange(self, msg: Poll) -> list[Message]: ...


PeerState = Literal["unknown", "up", "down"]


class PeerPoller:
    """Polls one peer operator; admits what it sends. Status for gridctl.

    state: "unknown" until the first poll ends, then "up" or "down"; a change is logged
    once (not every failed poll).
    """

    def __init__(
        self,
        peer: PeerConfig,
        *,
        fences: AdmissionFences,
        holdings: Holdings,
        timings: Callable[[], TimingConfig],
        wall: Callable[[], float],
        transitions: TransitionLog | None = None,
        intake: PeerIntake | None = None,
        limits: Callable[[], LimitsConfig] = LimitsConfig,
    ) -> None:
        self.peer = peer
        self.fences = fences
        self.holdings = holdings
        self.timings = timings
        self.wall = wall
        # Shared by the supervisor, so a restarted poller keeps the peer's line budget.
        self.transitions = transitions if transitions is not None else TransitionLog()
        self.intake = intake if intake is not None else PeerIntake()
        self.limits = limits
        # Batches refused by the per-peer bounds (gridd.core.peer_intake), by reason.
        self.refused: dict[str, int] = dict.fromkeys(INTAKE_REFUSALS, 0)
        self._refusal_logged_at = -math.inf
        self.link: PeerLink | None = None
        self.state: PeerState = "unknown"
        self.last_success_at: float | None = None
        self.last_error: str | None = None
        self.last_error_detail = ""
        self.polls = 0
        self.failures = 0
        self.admitted = {"accepted": 0, "repeat": 0, "dropped": 0}

    async def run(self, link: PeerLink, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.link = link
        task_status.started()
        next_at = trio.current_time()
        while True:
            await self.poll_once()
            # Drift-free (STYLE 9): the schedule advances from the previous start, so the
            # interval is start to start. An exchange that overran it (the budget may be
            # longer than the interval) skips the ticks it missed and stays on the grid.
            interval = self.timings().peer_poll_interval_s
            next_at += interval
            now = trio.current_time()
            if next_at < now:
                next_at += math.ceil((now - next_at) / interval) * interval
            await trio.sleep_until(next_at)

    async def poll_once(self) -> None:
        assert self.link is not None
        budget_s = self.timings().peer_poll_budget_s
        self.polls += 1
        replies: list[Message] | None = None
        # The caller owns the timeout (STYLE 3): one budget covers any re-dial, the TLS
        # and WebSocket handshakes and the exchange itself.
        with trio.move_on_after(budget_s):
            try:
                replies = await self.link.exchange(Poll(protocol=PROTOCOL_VERSION, sent_wall=self.wall()))
            except ChannelError as exc:
                if exc.reason == "decode":
                    self.fences.note_decode_error()
                self._failed(exc.reason, str(exc))
                return
        if replies is None:
            self._failed("timeout", f"no answer within the {budget_s:g} s poll budget")
            return
        answer = replies[-1] if replies else None
        if not isinstance(answer, Batches):
            self._failed("protocol", f"poll answered with {type(answer).__name__}")
            return
        self._admit(answer.batches, answer.removed)
        self._succeeded()

    def _admit(self, batches: tuple[Batch, ...], removed: tuple[SourceKey, ...] = ()) -> None:
        # The dialer required the server's verified certificate to name this peer's
        # site (ExpectedPeer), so that is the site its batches may claim.
        identity = self.link.identity if self.link is not None else None
        verified_site = identity.site if identity is not None else self.peer.site
        now, now_wall = trio.current_time(), self.wall()
        for key in removed:
            # A peer announces removals of its own site's providers only, and only of ones
            # held here (an announcement never creates state).
            if key.site == verified_site and self.holdings.get(key.site, key.provider) is not None:
                self.holdings.remove(key.site, key.provider, now)
        max_providers = self.limits().peer_max_providers
        refused_now = 0
        for batch in batches:
            refusal = self.intake.take(verified_site, batch.site, batch.provider, now=now,
                                       max_providers=max_providers)
            if refusal is not None:
                self.refused[refusal] += 1
                self.admitted["dropped"] += 1
                refused_now += 1
                continue
            verdict = self.fences.admit(batch, now_wall=now_wall, verified_site=verified_site)
            if verdict.outcome is Outcome.ACCEPTED:
                self.holdings.hold(batch, now)
                self.admitted["accepted"] += 1
            elif verdict.outcome is Outcome.REPEAT:
                # Spec: a repeat leaves the held reading's age unchanged: not re-held.
                self.admitted["repeat"] += 1
            else:
                self.admitted["dropped"] += 1
                log.debug("peer %s: batch %s/%s dropped (%s): %s", self.peer.site, batch.site,
                          batch.provider, verdict.reason, verdict.detail)
        if refused_now and now - self._refusal_logged_at >= REFUSAL_LOG_EVERY_S:
            # One line per REFUSAL_LOG_EVERY_S at most, however hard the peer floods.
            self._refusal_logged_at = now
            log.warning("peer %s: refusing batches over its bounds (%d this poll; %d provider names held, cap %d; "
                        "names over %d characters refused): totals %s", self.peer.site, refused_now,
                        self.intake.held(verified_site), max_providers, NAME_MAX, self.refused)

    def _succeeded(self) -> None:
        self.last_success_at = trio.current_time()
        self.last_error, self.last_error_detail = None, ""
        if (line := self.transitions.observe(self.peer.site, "up", self.last_success_at)) is not None:
            log.info("peer %s (%s) is up%s", self.peer.site, self.peer.url, line.suffix())
        self.state = "up"

    def _failed(self, reason: str, detail: str) -> None:
        self.failures += 1
        # Logged on a change only (gridd/core/transitions.py): going down, or staying down
        # for another reason (say unreachable, then reachable with the wrong certificate),
        # never per failed poll, and at most a few lines a minute for a flapping peer.
        line = self.transitions.observe(self.peer.site, f"down ({reason})", trio.current_time())
        if line is not None:
            still = "still down, now" if line.old is not None and line.old.startswith("down") else "down"
            log.warning("peer %s (%s) is %s (%s): %s%s", self.peer.site, self.peer.url, still, reason, detail,
                        line.suffix())
        self.last_error, self.last_error_detail = reason, detail
        self.state = "down"

    def status(self, now: float) -> dict[str, Any]:
        link = self.link
        return {
            "site": self.peer.site,
            "url": self.peer.url,
            "state": self.state,
            "last_success_age_s": None if self.last_success_at is None else round(now - self.last_success_at, 3),
            "last_error": self.last_error,
            "last_error_detail": self.last_error_detail,
            "connections": link.connections_opened if link is not None else 0,
            "polls": self.polls,
            "failures": self.failures,
            "batches": dict(self.admitted),
            "refused": dict(self.refused),
        }


class PeerTask:
    """One supervised poller: its peer, its cancel scope, its state."""

    __slots__ = ("peer", "scope", "poller")

    def __init__(self, peer: PeerConfig, poller: PeerPoller) -> None:
        self.peer = peer
        self.scope = trio.CancelScope()
        self.poller = poller


OpenLink = Callable[[PeerConfig], AbstractAsyncContextManager[PeerLink]]


class PeerSupervisor:
    """The peer pollers of one operator, keyed by (site, url), plus the TTL expiry task."""

    def __init__(
        self,
        *,
        own_site: str,
        fences: AdmissionFences,
        holdings: Holdings,
        timings: Callable[[], TimingConfig],
        wall: Callable[[], float],
        open_link: OpenLink,
        limits: Callable[[], LimitsConfig] = LimitsConfig,
    ) -> None:
        self.own_site = own_site
        self.fences = fences
        self.holdings = holdings
        self.timings = timings
        self.wall = wall
        self.open_link = open_link
        self.limits = limits
        self.intake = PeerIntake()
        self.tasks: dict[tuple[str, str], PeerTask] = {}
        self._nursery: trio.Nursery | None = None
        self.transitions = TransitionLog()

    @property
    def running(self) -> bool:
        return self._nursery is not None

    async def run(self, peers: list[PeerConfig], *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                self.update(peers)
                nursery.start_soon(self._expire_loop, name="signals-expiry")
                task_status.started()
                await trio.sleep_forever()
            finally:
                self._nursery = None

    def update(self, peers: list[PeerConfig], *, restart_all: bool = False) -> list[tuple[str, str]]:
        """Diff the configured peers against the running pollers (STYLE 7): stop the
        removed, start the new, keep the unchanged (a changed ingress only updates the
        record). restart_all: new TLS material, so every connection is redone.
        Returns the keys started."""
        assert self._nursery is not None, "update() before run()"
        wanted = {(p.site, p.url): p for p in peers}
        for key, task in list(self.tasks.items()):
            if restart_all or key not in wanted:
                task.scope.cancel()
                del self.tasks[key]
                if key[0] not in {site for site, _ in wanted}:
                    self.transitions.forget(key[0])
        started = []
        for key, peer in wanted.items():
            task = self.tasks.get(key)
            if task is not None:
                task.peer = task.poller.peer = peer
                continue
            task = self.tasks[key] = PeerTask(peer, PeerPoller(
                peer, fences=self.fences, holdings=self.holdings, timings=self.timings, wall=self.wall,
                transitions=self.transitions, intake=self.intake, limits=self.limits))
            self._nursery.start_soon(self._run_peer, task, name=f"peer-poller-{peer.site}")
            started.append(key)
        return started

    async def _run_peer(self, task: PeerTask) -> None:
        with task.scope:
            while True:
                try:
                    async with self.open_link(task.peer) as link:
                        await task.poller.run(link)
                except Exception:
                    # A bug in one poller must not stop the others; it starts over.
                    log.exception("peer %s: poller failed; restarting it", task.peer.site)
                    await trio.sleep(self.timings().peer_poll_interval_s)

    async def _expire_loop(self) -> None:
        # A silent peer's readings are still relayed, ageing, for RELAY_RETENTION_TTLS x the
        # signal TTL: gateways then hold them as stale and sort that site last (loss of
        # signal degrades to least preferred, not to idle) instead of losing it at the very
        # moment it goes stale. /metrics stops showing them at the TTL itself (a series the
        # operator does not hold fresh is absent, not 0: see the exporter). The own site is
        # kept (its batches refresh every pass and its failures travel as verdicts).
        next_at = trio.current_time()
        while True:
            ttl = self.timings().signal_ttl_s
            gone = self.holdings.expire(trio.current_time(), ttl * RELAY_RETENTION_TTLS, keep_site=self.own_site)
            if gone:
                log.info("dropped %d readings older than %g s (%g x the signal TTL): %s", len(gone),
                         ttl * RELAY_RETENTION_TTLS, RELAY_RETENTION_TTLS,
                         ", ".join(f"{site}/{provider}" for site, provider in gone))
            # Names a peer stopped sending: their admission fences go too, after the same
            # retention, so a peer cycling through names cannot grow the fences without bound.
            for site, provider in self.intake.forget_unseen(now=trio.current_time(),
                                                           retention_s=ttl * RELAY_RETENTION_TTLS):
                self.fences.forget(site, provider)
                self.holdings.forget(site, provider)
            next_at += EXPIRE_EVERY_S
            await trio.sleep_until(next_at)

    def status(self) -> list[dict[str, Any]]:
        now = trio.current_time()
        return [task.poller.status(now) for task in self.tasks.values()]
