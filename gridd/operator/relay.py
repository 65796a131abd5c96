"""The operator's relay: who may connect to its channel and what each is sent.

``RelayEndpoint.handle`` runs once per authenticated connection (gridd/link/serve.py):

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

docs/signals-channel.md is the long form, with every timeout.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Final, Literal

import msgspec
import trio

from gridd.config_schema import Config
from gridd.core.holdings import Holdings
from gridd.link.session import ChannelError, ChannelSession
from gridd.operator.channel_setup import ChannelMetrics
from gridd.tls import PeerIdentity
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
    WireEncodeError,
    encode,
    protocol_refusal,
)

log = logging.getLogger("gridd.operator.relay")

# The answer to a feedback report from an endpoint built without a feedback intake: a
# defined status that the gateway's reporter counts as not accepted (DESIGN 5b).
FEEDBACK_NOT_IMPLEMENTED: Final = "not_implemented"

# Takes one report from a verified gateway of this site and answers it (the operator's
# evidence ledger, gridd.operator.service.OperatorService.take_feedback).
FeedbackIntake = Callable[[PeerIdentity, FeedbackReport], Awaitable[FeedbackAck]]

PeerRole = Literal["peer", "gateway"]


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


class RelayEndpoint:
    """The handler serve_channel runs for every connection to this operator."""

    def __init__(
        self,
        *,
        config: Callable[[], Config],
        holdings: Holdings,
        metrics: ChannelMetrics,
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

    async def _refuse(self, session: ChannelSession, error: Error, *, counted_as: str | None = None) -> None:
        reason = counted_as or error.reason
        log.info("signals: refusing %s (%s): %s", session.where, reason, error.detail)
        self.metrics.count_refused(reason)
        try:
            await session.send(error)
        except ChannelError:
            pass  # gone already; the refusal is counted either way

    async def handle(self, session: ChannelSession) -> None:
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

    async def _serve(self, session: ChannelSession, role: PeerRole) -> None:
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
                        ack = FeedbackAck(reporter_epoch=epoch, sequence=sequence,
                                          status=FEEDBACK_NOT_IMPLEMENTED,
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
