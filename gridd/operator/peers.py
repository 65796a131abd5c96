"""The operator's peer pollers: one per configured peer operator, and the expiry of what
they brought.

``PeerSupervisor`` keeps one task per configured peer (gridd.link.supervisor), keyed by
the peer's (site, url) (STYLE 7). Each runs the shared poller (gridd.link.poller) over a
persistent connection (gridd.link.dial.ChannelDialer in the daemon): every
peer_poll_interval_s, start to start, one exchange bounded by peer_poll_budget_s; each
batch passes the per-peer bounds and the admission fences before it may touch the
holdings. A reload restarts only the pollers whose (site, url) changed, or all of them
when the TLS material changed; the holdings and fences are shared and never rebuilt.

docs/signals-channel.md is the long form, with every timeout.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from functools import partial
from typing import Any, Final

import trio

from gridd.config_schema import LimitsConfig, PeerConfig, TimingConfig
from gridd.core.admission import AdmissionFences, Outcome
from gridd.core.holdings import Holdings
from gridd.core.peer_intake import INTAKE_REFUSALS, NAME_MAX, PeerIntake
from gridd.core.transitions import TransitionLog
from gridd.link.periodic import run_periodic
from gridd.link.poller import LinkLines, LinkState, PollAnswer, Poller, PollLink
from gridd.link.session import ChannelError
from gridd.link.supervisor import TaskSupervisor
from gridd.wire import PROTOCOL_VERSION, Batch, Poll, SourceKey

log = logging.getLogger("gridd.operator.peers")

# How often peer readings older than the signal TTL are dropped from the holdings, so a
# dead peer's series leave /metrics within TTL + this.
EXPIRE_EVERY_S: Final = 1.0
RELAY_RETENTION_TTLS = 2.0
"""A peer's reading is relayed (stale) until this many signal TTLs old, then forgotten."""
REFUSAL_LOG_EVERY_S = 60.0
"""A peer over its bounds (gridd.core.peer_intake) is logged at most this often."""

PeerState = LinkState


class PeerPoller:
    """Polls one peer operator (gridd.link.poller.Poller) and admits what it sends.
    Status for gridctl; ``state`` is "unknown" until the first poll ends, then "up" or
    "down", a change logged once (not every failed poll)."""

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
        self.intake = intake if intake is not None else PeerIntake()
        self.limits = limits
        # Batches refused by the per-peer bounds (gridd.core.peer_intake), by reason.
        self.refused: dict[str, int] = dict.fromkeys(INTAKE_REFUSALS, 0)
        self._refusal_logged_at = -math.inf
        self.admitted = {"accepted": 0, "repeat": 0, "dropped": 0}
        self.poller = Poller(
            target=peer.site,
            lines=LinkLines(
                log, up=f"peer {peer.site} ({peer.url}) is up{{suffix}}",
                down=f"peer {peer.site} ({peer.url}) is {{down}} ({{reason}}): {{detail}}{{suffix}}",
                timeout="no answer within the {budget_s:g} s poll budget"),
            # Shared by the supervisor, so a restarted poller keeps the peer's line budget.
            transitions=transitions if transitions is not None else TransitionLog(),
            interval_s=lambda: self.timings().peer_poll_interval_s,
            budget_s=lambda: self.timings().peer_poll_budget_s,
            request=lambda: Poll(protocol=PROTOCOL_VERSION, sent_wall=self.wall()),
            admit=self._admit, on_failure=self._note_failure)

    @property
    def transitions(self) -> TransitionLog:
        return self.poller.transitions

    @property
    def state(self) -> PeerState:
        return self.poller.state

    async def run(self, link: PollLink, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await self.poller.run(link, task_status=task_status)

    def _note_failure(self, exc: ChannelError, now: float) -> None:
        if exc.reason == "decode":
            self.fences.note_decode_error()

    def _admit(self, answer: PollAnswer, now: float) -> None:
        self._admit_batches(answer.batches.batches, answer.batches.removed)

    def _admit_batches(self, batches: tuple[Batch, ...], removed: tuple[SourceKey, ...] = ()) -> None:
        # The dialer required the server's verified certificate to name this peer's
        # site (ExpectedPeer), so that is the site its batches may claim.
        link = self.poller.link
        identity = link.identity if link is not None else None
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
            log.warning("peer %s: refusing batches over its bounds (%d this poll; %d provider names held, "
                        "cap %d; names over %d characters refused): totals %s", self.peer.site, refused_now,
                        self.intake.held(verified_site), max_providers, NAME_MAX, self.refused)

    def status(self, now: float) -> dict[str, Any]:
        p = self.poller
        return {
            "site": self.peer.site,
            "url": self.peer.url,
            "state": p.state,
            "last_success_age_s": None if p.last_success_at is None else round(now - p.last_success_at, 3),
            "last_error": p.last_error,
            "last_error_detail": p.last_error_detail,
            "connections": p.link.connections_opened if p.link is not None else 0,
            "polls": p.polls,
            "failures": p.failures,
            "batches": dict(self.admitted),
            "refused": dict(self.refused),
        }


class PeerTask:
    """One supervised poller: its peer, its cancel scope, its state."""

    __slots__ = ("peer", "scope", "poller")

    def __init__(self, peer: PeerConfig, poller: PeerPoller) -> None:
        self.peer = peer
        self.scope = trio.CancelScope()  # replaced by the supervisor's when started
        self.poller = poller


OpenLink = Callable[[PeerConfig], AbstractAsyncContextManager[PollLink]]


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
        self.supervisor: TaskSupervisor[tuple[str, str]] = TaskSupervisor(
            restart_delay_s=lambda: self.timings().peer_poll_interval_s, log=log)
        self.transitions = TransitionLog()

    @property
    def running(self) -> bool:
        return self.supervisor.running

    async def run(self, peers: list[PeerConfig], *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(self.supervisor.run)
            try:
                self.update(peers)
                nursery.start_soon(self._expire_loop, name="signals-expiry")
                task_status.started()
                await trio.sleep_forever()
            finally:
                self.tasks.clear()

    def update(self, peers: list[PeerConfig], *, restart_all: bool = False) -> list[tuple[str, str]]:
        """Diff the configured peers against the running pollers (STYLE 7): stop the
        removed, start the new, keep the unchanged (a changed ingress only updates the
        record). restart_all: new TLS material, so every connection is redone.
        Returns the keys started."""
        if not self.supervisor.running:
            raise RuntimeError("PeerSupervisor.update() before run()")
        wanted = {(p.site, p.url): p for p in peers}
        for key in list(self.tasks):
            if restart_all or key not in wanted:
                self.supervisor.stop(key)
                del self.tasks[key]
                if key[0] not in {site for site, _ in wanted}:
                    self.transitions.forget(key[0])
        started = []
        for key, peer in wanted.items():
            task = self.tasks.get(key)
            if task is not None:
                task.peer = task.poller.peer = peer
                continue
            poller = PeerPoller(peer, fences=self.fences, holdings=self.holdings, timings=self.timings,
                                wall=self.wall, transitions=self.transitions, intake=self.intake,
                                limits=self.limits)
            task = self.tasks[key] = PeerTask(peer, poller)
            task.scope = self.supervisor.start(key, partial(self._poll_peer, task),
                                               label=f"peer {peer.site}: poller")
            started.append(key)
        return started

    async def _poll_peer(self, task: PeerTask) -> None:
        # task.peer: a reload that changed only the ingress updates the record in place.
        async with self.open_link(task.peer) as link:
            await task.poller.run(link)

    async def _expire_loop(self) -> None:
        # A silent peer's readings are still relayed, ageing, for RELAY_RETENTION_TTLS x the
        # signal TTL: gateways then hold them as stale and sort that site last (loss of
        # signal degrades to least preferred, not to idle) instead of losing it at the very
        # moment it goes stale. /metrics stops showing them at the TTL itself (a series the
        # operator does not hold fresh is absent, not 0: see the exporter). The own site is
        # kept (its batches refresh every pass and its failures travel as verdicts).
        await run_periodic(lambda: EXPIRE_EVERY_S, self._expire_once)

    async def _expire_once(self) -> None:
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

    def status(self) -> list[dict[str, Any]]:
        now = trio.current_time()
        return [task.poller.status(now) for task in self.tasks.values()]
