"""One poller for both roles: a peer operator polling another site's operator, and a
gateway polling its own site's operator.

Every ``interval_s()`` (gridd/link/periodic.py: drift-free, start to start, one overrun
policy) one Poll exchange over the link, bounded by ``budget_s()``: the caller owns the
timeout (STYLE 3), and one budget covers any re-dial, the TLS and WebSocket handshakes and
the exchange itself. A poll ends as an answer, handed to the role's ``admit``, or as a
ChannelError (the link's own, or "timeout" when the budget ran out), handed to the role's
``on_failure``. Either way the link's state goes "up" or "down (<reason>)", and a change is
logged as one line (gridd/core/transitions.py: rate-limited, never one line per poll).
``after_poll`` then runs on the same link (the gateway's feedback report rides there).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Literal, NamedTuple, NoReturn, Protocol

import trio

from gridd.core.transitions import TransitionLog
from gridd.link.periodic import run_periodic
from gridd.link.session import ChannelError
from gridd.tls import PeerIdentity
from gridd.wire import Batches, FeedbackReport, Message, Poll, ServingConfig

__all__ = ["LinkLines", "LinkState", "PollAnswer", "PollLink", "Poller", "poll_answer"]

LinkState = Literal["unknown", "up", "down"]


class PollLink(Protocol):
    """What a poller needs from its connection (gridd.link.dial.ChannelDialer in the daemon).

    ``exchange`` keeps the dialer's contract: a Poll is answered [ServingConfig?, Batches],
    a FeedbackReport [FeedbackAck]; every failure is a ChannelError.
    """

    @property
    def identity(self) -> PeerIdentity | None: ...

    @property
    def connections_opened(self) -> int: ...

    async def exchange(self, msg: Poll | FeedbackReport) -> list[Message]: ...


class PollAnswer(NamedTuple):
    """A Poll's answer: the serving config when it changed (gateways only), and the batches."""

    serving: ServingConfig | None
    batches: Batches


def poll_answer(replies: list[Message]) -> PollAnswer:
    """The typed answer of a Poll exchange; ChannelError("protocol") for replies that break
    the dialer's contract (the dialer itself raises before returning such a list)."""
    match replies:
        case [Batches() as batches]:
            return PollAnswer(None, batches)
        case [ServingConfig() as serving, Batches() as batches]:
            return PollAnswer(serving, batches)
    kinds = ", ".join(type(r).__name__ for r in replies) or "nothing"
    raise ChannelError(f"poll answered with {kinds}", reason="protocol")


class LinkLines(NamedTuple):
    """The lines a poller logs on a change of its link's state, as str.format templates.

    up: fields {suffix}. down: {down} ("down", or "still down, now" when it was down for
    another reason), {reason}, {detail}, {suffix}. timeout: the detail of a poll whose
    budget ran out, field {budget_s}.
    """

    logger: logging.Logger
    up: str
    down: str
    timeout: str


def _no_failure_hook(exc: ChannelError, now: float) -> None:
    return None


class Poller:
    """Polls one operator over one link. Status: ``state`` ("unknown" until the first poll
    ends), ``polls``, ``failures``, ``results`` (count per "ok" / failure reason, shared
    across restarts when the caller passes one in), ``last_success_at``, ``last_error``
    and ``last_error_detail``."""

    def __init__(
        self,
        *,
        target: str,
        lines: LinkLines,
        transitions: TransitionLog,
        interval_s: Callable[[], float],
        budget_s: Callable[[], float],
        request: Callable[[], Poll],
        admit: Callable[[PollAnswer, float], None],
        on_failure: Callable[[ChannelError, float], None] = _no_failure_hook,
        after_poll: Callable[[PollLink, bool], Awaitable[None]] | None = None,
        results: dict[str, int] | None = None,
    ) -> None:
        """target: the key of this link in ``transitions`` (shared, so a restarted poller
        keeps the target's line budget). request: the Poll to send, built at send time.
        admit(answer, now) and on_failure(error, now): the role's handling of each end.
        after_poll(link, failed): runs after each poll's own result is settled."""
        self.target = target
        self.lines = lines
        self.transitions = transitions
        self.interval_s = interval_s
        self.budget_s = budget_s
        self.request = request
        self.admit = admit
        self.on_failure = on_failure
        self.after_poll = after_poll
        self.results = results if results is not None else {"ok": 0}
        self.link: PollLink | None = None
        self.state: LinkState = "unknown"
        self.last_success_at: float | None = None
        self.last_error: str | None = None
        self.last_error_detail = ""
        self.polls = 0
        self.failures = 0

    async def run(self, link: PollLink, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
                  ) -> NoReturn:
        """Poll over ``link`` now and then every interval, until cancelled."""
        self.link = link
        task_status.started()
        await run_periodic(self.interval_s, self.poll_once)

    async def poll_once(self) -> None:
        link = self.link
        if link is None:
            raise RuntimeError("poll_once() before run(): no link")
        budget_s = self.budget_s()
        self.polls += 1
        answer: PollAnswer | None = None
        failure = ChannelError(self.lines.timeout.format(budget_s=budget_s), reason="timeout")
        with trio.move_on_after(budget_s):
            try:
                answer = poll_answer(await link.exchange(self.request()))
            except ChannelError as exc:
                failure = exc
        now = trio.current_time()
        if answer is not None:
            self.admit(answer, now)
            self._succeeded(now)
        else:
            self.on_failure(failure, now)
            self._failed(failure.reason, str(failure), now)
        if self.after_poll is not None:
            await self.after_poll(link, answer is None)

    def _succeeded(self, now: float) -> None:
        self.results["ok"] = self.results.get("ok", 0) + 1
        self.last_success_at = now
        self.last_error, self.last_error_detail = None, ""
        if (line := self.transitions.observe(self.target, "up", now)) is not None:
            self.lines.logger.info("%s", self.lines.up.format(suffix=line.suffix()))
        self.state = "up"

    def _failed(self, reason: str, detail: str, now: float) -> None:
        self.failures += 1
        self.results[reason] = self.results.get(reason, 0) + 1
        # Logged on a change only (gridd/core/transitions.py): going down, or staying down
        # for another reason (say unreachable, then reachable with the wrong certificate),
        # never per failed poll, and at most a few lines a minute for a flapping link.
        line = self.transitions.observe(self.target, f"down ({reason})", now)
        if line is not None:
            still = "still down, now" if line.old is not None and line.old.startswith("down") else "down"
            self.lines.logger.warning("%s", self.lines.down.format(down=still, reason=reason, detail=detail,
                                                                   suffix=line.suffix()))
        self.last_error, self.last_error_detail = reason, detail
        self.state = "down"
