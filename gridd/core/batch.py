"""One provider's batch and the keys that name it: the values the signals channel carries.

The core admits, holds, relays and learns from these; gridd.wire carries them inside its
messages and encodes them. They are wire values all the same, so the evolution rules of
docs/wire.md bind them: a new field always gets a default that never changes, and the
``array_like`` structs (``SourceKey``, ``Cursor`` here; ``UnitLoad``, ``Revision`` and
``BatchOrder`` in gridd.core.readings) only ever grow at the end.
"""

from __future__ import annotations

from typing import Final

import msgspec

from gridd.core.readings import BatchOrder, LatencyBlock, LoadSignals, Revision

__all__ = ["WIRE_INT_MAX", "Batch", "Cursor", "SourceKey", "ordering", "with_added_age"]

# The largest counter or sequence on the wire (int64, the widest msgspec bound checks).
# Counters and sequences latch here instead of wrapping (spec: "The highest sequence
# and counter values latch").
WIRE_INT_MAX: Final = 2**63 - 1


class SourceKey(msgspec.Struct, frozen=True, array_like=True):
    """One provider at one site: the key of every per-provider reading."""

    site: str
    provider: str


class Cursor(msgspec.Struct, frozen=True, array_like=True):
    """The (publisher_epoch, batch_sequence) of the batch a poller holds for one provider."""

    site: str
    provider: str
    publisher_epoch: int
    batch_sequence: int


class Batch(msgspec.Struct, frozen=True, omit_defaults=True):
    """One provider's publication from one scrape (DESIGN 5). Relays forward it whole.

    revision: None when the publication has no revision metadata; such a batch cannot
        be ordered and disables learning downstream, but its pressure signals are usable.
    complete: qualified and complete (DESIGN 5b): the scrape succeeded, was not cut at
        the body cap, and the batch carries revision metadata and all of its samples.
    ready: the operator's readiness verdict; None = unknown (no ready-endpoint series).
    ready_reason: the verdict's reason (the provider's Ready condition reason).
    load / latency: None when the scrape produced none (failed, or too few requests).
    probes: probe metadata, ``<prefix>.<name>`` -> value.
    probe_age_s: per probes key, how much older than the batch's sample the value is (the
        time since the probe tick that produced it; a failing probe keeps its last values,
        which age). A receiver's value age is ``age_s + probe_age_s[key]``; a key absent here
        (an older operator) is as old as the batch.
    published_ms: the operator's wall clock at publication, milliseconds.
    age_s: how old the sample is at send time, in seconds. Relative, so no receiver
        trusts a sender's monotonic clock; each relay adds its holding time.
    order: (publisher_epoch, batch_sequence) of a batch without revision metadata, so
        receivers order every batch by epoch and sequence (see ordering()). None on a
        batch with a revision (the revision carries them) and from older operators,
        whose revision-less batches are ordered by published_ms.
    """

    site: str
    provider: str
    model: str
    published_ms: int
    age_s: float
    revision: Revision | None = None
    complete: bool = False
    ready: bool | None = None
    ready_reason: str = ""
    load: LoadSignals | None = None
    latency: LatencyBlock | None = None
    probes: dict[str, float] = {}
    order: BatchOrder | None = None
    probe_age_s: dict[str, float] = {}


def ordering(batch: Batch) -> tuple[int, int] | None:
    """The (publisher_epoch, batch_sequence) a receiver orders ``batch`` by: its revision's,
    else its order's; None for a revision-less batch from an older operator."""
    if batch.revision is not None:
        return batch.revision.publisher_epoch, batch.revision.batch_sequence
    if batch.order is not None:
        return batch.order.publisher_epoch, batch.order.batch_sequence
    return None


def with_added_age(batch: Batch, held_s: float) -> Batch:
    """The batch as a relay forwards it: its age plus the time the relay held it.

    held_s is a monotonic-clock difference taken by the relay itself; a negative value
    (impossible from a monotonic clock) is treated as 0 so age never runs backwards.
    """
    return msgspec.structs.replace(batch, age_s=batch.age_s + max(held_s, 0.0))
