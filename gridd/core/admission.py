"""Batch admission and publication fences, shared by operators (hubs) and gateways.

Every batch a receiver takes off the signals channel passes ``AdmissionFences.admit``
before it may touch the store. Admission decides, per (site, provider):

    ACCEPTED  a new reading; the caller stores it (and its age).
    REPEAT    the publication already admitted; the caller changes nothing: the held
              reading keeps its age and learning lifetime, and nothing is counted.
    DROPPED   with a bounded reason, counted here for
              grid_signals_ingest_dropped_total{reason}.

Pure: no IO, the receiver's wall clock comes in as ``now_wall`` (seconds). Memory is
one entry per (site, provider) the receiver has admitted or fenced, plus at most
SKEW_EVIDENCE_MAX skew-evidence entries.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from typing import Final, Literal

import msgspec

from gridd.core.batch import WIRE_INT_MAX, Batch, Cursor, ordering
from gridd.core.feedback_values import FEEDBACK_EVIDENCE_MAX, SkewEvidence
from gridd.core.payload import validate_payload

__all__ = [
    "ACCEPTED",
    "DROP_REASONS",
    "FUTURE_EPOCH_BOUND_S",
    "REPEAT",
    "SKEW_EVIDENCE_MAX",
    "Admission",
    "AdmissionFences",
    "DropReason",
    "Outcome",
]

DropReason = Literal["skew", "stale_order", "identity", "decode", "invalid"]

# The bounded label set of grid_signals_ingest_dropped_total{reason}.
DROP_REASONS: Final[tuple[DropReason, ...]] = ("skew", "stale_order", "identity", "decode", "invalid")

# Spec: "hubs and gateways reject epochs more than ten minutes ahead of their own wall
# clock, matching SWIM's lease bound". DESIGN 5: a config knob, default 600 s.
FUTURE_EPOCH_BOUND_S: Final = 600.0

# Skew evidence kept for the feedback reporter: as many as one report can carry.
SKEW_EVIDENCE_MAX: Final = FEEDBACK_EVIDENCE_MAX


class Outcome(enum.Enum):
    ACCEPTED = "accepted"
    REPEAT = "repeat"
    DROPPED = "dropped"


class Admission(msgspec.Struct, frozen=True):
    """The verdict on one batch. ``reason`` is set only for DROPPED; ``detail`` is for logs."""

    outcome: Outcome
    reason: DropReason | None = None
    detail: str = ""


ACCEPTED: Final = Admission(Outcome.ACCEPTED)
REPEAT: Final = Admission(Outcome.REPEAT)


class _SourceState:
    """What admission remembers about one (site, provider)."""

    __slots__ = ("fence", "fence_content", "fence_admitted", "latest", "latest_published_ms")

    def __init__(self) -> None:
        # The highest (publisher_epoch, batch_sequence) seen with valid ordering
        # metadata, whether its payload was admitted or rejected.
        self.fence: tuple[int, int] | None = None
        # The publication at the fence, without its age, to tell a repeat from a replay.
        self.fence_content: Batch | None = None
        self.fence_admitted = False
        # The latest admitted reading of either kind, without its age.
        self.latest: Batch | None = None
        # Highest published_ms among admitted readings; orders revision-less batches.
        self.latest_published_ms: int | None = None


def _without_age(batch: Batch) -> Batch:
    # Relays add their holding time to age_s, so two deliveries of one publication
    # differ only there; identity is everything else.
    return batch if batch.age_s == 0.0 else msgspec.structs.replace(batch, age_s=0.0)


class AdmissionFences:
    """Per-(site, provider) fences, drop counters and skew evidence of one receiver."""

    def __init__(self, *, future_epoch_bound_s: float = FUTURE_EPOCH_BOUND_S) -> None:
        self.future_epoch_bound_s = future_epoch_bound_s
        self._sources: dict[tuple[str, str], _SourceState] = {}
        self._drops: dict[DropReason, int] = dict.fromkeys(DROP_REASONS, 0)
        # Insertion-ordered set, oldest first; a re-rejected batch moves to the end.
        self._skew_evidence: OrderedDict[SkewEvidence, None] = OrderedDict()

    # --- admission ------------------------------------------------------------------

    def admit(self, batch: Batch, *, now_wall: float, verified_site: str | None) -> Admission:
        """Admit one batch. ``verified_site``: the site a direct peer's certificate
        names; None for data relayed by the receiver's own operator."""
        # a. DESIGN 2: "A peer's readings are attributed only to the site its verified
        #    identity names; a peer claiming another site's data is dropped and counted."
        if verified_site is not None and batch.site != verified_site:
            return self._drop("identity", f"peer {verified_site!r} sent a batch for site {batch.site!r}")
        if not batch.site or not batch.provider:
            return self._drop("invalid", "empty site or provider")

        key = (batch.site, batch.provider)
        # Spec: "Receivers order batches by publisher epoch and sequence to reject delayed
        # data." Every batch of a current operator carries them: a qualified one in its
        # revision, a verdict-only one in its order (gridd.wire.ordering). Only an older
        # operator's revision-less batch has none.
        order = ordering(batch)
        if order is None:
            return self._admit_unordered(key, batch, now_wall)

        epoch, sequence = order
        if epoch < 0 or sequence < 0:
            # Not valid ordering metadata: nothing to fence with, nothing retained.
            return self._drop("invalid", f"negative ordering metadata ({epoch}, {sequence})")

        # b. Spec: "At admission, hubs and gateways reject epochs more than ten minutes
        #    ahead of their own wall clock ... before retaining any publication fence."
        #    Exactly the bound ahead is accepted.
        if epoch > now_wall + self.future_epoch_bound_s:
            self._remember_skew(SkewEvidence(batch.site, batch.provider, epoch, sequence))
            return self._drop(
                "skew", f"publisher_epoch {epoch} is {epoch - now_wall:.0f}s ahead of the local wall clock"
            )

        # c. Spec: "Receivers order batches by publisher epoch and sequence to reject
        #    delayed data."
        content = _without_age(batch)
        state = self._sources.get(key)
        if state is not None:
            self._release_future_fence(state, now_wall)
        if state is not None and state.fence is not None:
            if order < state.fence:
                return self._drop("stale_order", f"{order} is behind the fence {state.fence}")
            if order == state.fence:
                if content != state.fence_content:
                    # Same ordering metadata, different payload: a replay, not a repeat.
                    return self._drop("stale_order", f"{order} replayed with a different payload")
                if state.fence_admitted:
                    # Spec: "Repeating a complete publication leaves its age and
                    # learning lifetime unchanged and is not counted as a parse drop."
                    return REPEAT
                # The same rejected payload again: rejected again.
                return self._drop("invalid", f"{order} repeats a rejected payload")

        # d. Spec: "Valid ordering metadata survives rejected payloads." DESIGN 5b: no
        #    reading is taken, but (epoch, sequence) still advances the fence, so an
        #    older or replayed batch cannot slip in after it.
        problem = validate_payload(batch)
        if state is None:
            state = self._sources[key] = _SourceState()
        state.fence = order
        state.fence_content = content
        state.fence_admitted = problem is None
        if problem is not None:
            return self._drop("invalid", problem)
        self._take_reading(state, content)
        return ACCEPTED

    def _admit_unordered(self, key: tuple[str, str], batch: Batch, now_wall: float) -> Admission:
        # e. Spec: "Missing or stale metadata disables learning while fresh pressure
        #    signals remain usable." An older operator's batch without a revision has no
        #    (epoch, sequence): it never creates, moves or is checked against a fence. It
        #    is ordered by its publisher's published_ms against every reading admitted for
        #    this provider, so a delayed one cannot replace a newer reading (but one
        #    published after a restart with the clock set back is dropped: the reason
        #    current operators stamp an order on every revision-less batch).
        content = _without_age(batch)
        state = self._sources.get(key)
        if state is not None:
            self._release_future_fence(state, now_wall)
            if content == state.latest:
                return REPEAT
            if state.latest_published_ms is not None and batch.published_ms <= state.latest_published_ms:
                return self._drop(
                    "stale_order",
                    f"revision-less batch published at {batch.published_ms} ms, "
                    f"not after {state.latest_published_ms} ms",
                )
        problem = validate_payload(batch)
        if problem is None and batch.published_ms / 1000.0 > now_wall + self.future_epoch_bound_s:
            # Its published_ms is its only ordering; one from too far ahead would hold
            # back every later revision-less batch, so the epoch bound applies to it.
            problem = f"published_ms {batch.published_ms} is beyond the future bound"
        if problem is not None:
            return self._drop("invalid", problem)
        if state is None:
            state = self._sources[key] = _SourceState()
        self._take_reading(state, content)
        return ACCEPTED

    def _release_future_fence(self, state: _SourceState, now_wall: float) -> None:
        """A fence further ahead of this receiver's wall clock than the skew bound orders
        nothing any more: every batch at or above it is dropped as skew (rule b) and every
        one below it as stale_order, which would lock the provider out until the clock
        reached it. It can only have been taken while this receiver's clock, or the
        publisher's, was wrong; once the clock is right again it is released, and the next
        batch that passes rule b starts the ordering afresh (docs/wire.md, "Clock steps").
        The same holds for the published_ms that orders an older operator's
        revision-less batches."""
        bound = now_wall + self.future_epoch_bound_s
        if state.fence is not None and state.fence[0] > bound:
            state.fence, state.fence_content, state.fence_admitted = None, None, False
        if state.latest_published_ms is not None and state.latest_published_ms / 1000.0 > bound:
            state.latest_published_ms = None

    @staticmethod
    def _take_reading(state: _SourceState, content: Batch) -> None:
        state.latest = content
        if state.latest_published_ms is None or content.published_ms > state.latest_published_ms:
            state.latest_published_ms = content.published_ms

    # --- counters and evidence ------------------------------------------------------

    def _drop(self, reason: DropReason, detail: str) -> Admission:
        # Counters latch at the wire's maximum instead of wrapping (spec).
        self._drops[reason] = min(self._drops[reason] + 1, WIRE_INT_MAX)
        return Admission(Outcome.DROPPED, reason, detail)

    def note_decode_error(self) -> Admission:
        """Count a frame that failed to decode (gridd.wire.WireDecodeError)."""
        return self._drop("decode", "frame did not decode")

    def _remember_skew(self, evidence: SkewEvidence) -> None:
        self._skew_evidence.pop(evidence, None)
        self._skew_evidence[evidence] = None
        while len(self._skew_evidence) > SKEW_EVIDENCE_MAX:
            self._skew_evidence.popitem(last=False)

    def drops(self) -> dict[DropReason, int]:
        """Cumulative drops by reason (every reason present, 0 when none)."""
        return dict(self._drops)

    def skew_evidence(self) -> tuple[SkewEvidence, ...]:
        """The most recent distinct skew rejections, oldest first, at most SKEW_EVIDENCE_MAX."""
        return tuple(self._skew_evidence)

    # --- fences ---------------------------------------------------------------------

    def fence(self, site: str, provider: str) -> tuple[int, int] | None:
        """The (publisher_epoch, batch_sequence) fence for one provider, if any."""
        state = self._sources.get((site, provider))
        return None if state is None else state.fence

    def cursors(self) -> tuple[Cursor, ...]:
        """Every fence as a Poll cursor."""
        return tuple(
            Cursor(site, provider, state.fence[0], state.fence[1])
            for (site, provider), state in self._sources.items()
            if state.fence is not None
        )

    def forget(self, site: str, provider: str) -> None:
        """Drop everything held for a deleted provider (its next batch starts fresh)."""
        self._sources.pop((site, provider), None)

    def __len__(self) -> int:
        return len(self._sources)
