"""The cursors a gateway's Poll carries, and the batches its operator left out because of them.

docs/wire.md (Cursors): a poller may list the (publisher_epoch, batch_sequence) it holds per
provider; the operator then leaves out each batch at exactly that cursor and names it in
``Batches.unchanged``. A gateway polls every second while a remote site's batches change
only when its operator polls that peer (every 5 s by default), so without cursors most of
every answer is a batch the gateway already holds: re-sent, re-encoded, re-decoded and
admitted as a repeat (docs/scaling.md has the figures).

A cursor is listed only for a candidate whose held batch is the one its fence admitted
last. The operator leaves out only a batch equal to that cursor, which is therefore that
same batch (same ordering, same payload; only its age would differ), and re-admitting the
held batch is the repeat the re-sent one would have been: counted as seen by the poll,
age and learning lifetime unchanged (spec: "Repeating a complete publication leaves its
age and learning lifetime unchanged"). A fence ahead of the held batch (a rejected payload
advanced it) gets no cursor, so such a batch is re-sent and judged exactly as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

from gridd.core.admission import AdmissionFences
from gridd.core.batch import Batch, Cursor, SourceKey, ordering


class HeldCandidate(Protocol):
    batch: Batch | None


def held_cursors(candidates: Mapping[tuple[str, str], HeldCandidate],
                 fences: AdmissionFences) -> tuple[Cursor, ...]:
    """One cursor per candidate whose held batch sits exactly at its fence."""
    out: list[Cursor] = []
    for cursor in fences.cursors():
        cand = candidates.get((cursor.site, cursor.provider))
        batch = cand.batch if cand is not None else None
        # Only a batch with a revision is ever left out (Holdings.relay_since).
        if batch is not None and batch.revision is not None \
                and ordering(batch) == (cursor.publisher_epoch, cursor.batch_sequence):
            out.append(cursor)
    return tuple(out)


def unchanged_batches(candidates: Mapping[tuple[str, str], HeldCandidate],
                      unchanged: Iterable[SourceKey]) -> list[Batch]:
    """The held batch of each provider the operator named unchanged, to be admitted (as a
    repeat) with the poll's other batches. A key no longer held (forgotten since the poll
    was sent) is left out: nothing to repeat."""
    out: list[Batch] = []
    for key in unchanged:
        cand = candidates.get((key.site, key.provider))
        if cand is not None and cand.batch is not None:
            out.append(cand.batch)
    return out
