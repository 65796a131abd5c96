"""What an operator holds: the latest batch per (site, provider), its own and its peers'.

Relays preserve sample age and whole batches (spec: Provider revisions): a batch is stored
as received, with the time it arrived, and leaves with its age increased by the time it
was held. Pure: ``now`` is passed in (monotonic seconds).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import msgspec

from gridd.core.batch import Batch, Cursor, SourceKey, with_added_age


class Held(msgspec.Struct, frozen=True):
    batch: Batch
    held_since: float

    def age_s(self, now: float) -> float:
        return self.batch.age_s + max(0.0, now - self.held_since)


class Holdings:
    def __init__(self) -> None:
        self._latest: dict[tuple[str, str], Held] = {}
        self._qualified: dict[tuple[str, str], Held] = {}
        # Providers removed from a site's config, with when: announced to gateways (and, for
        # the own site, to peers) so they answer 404 within one poll instead of holding
        # the provider as silent (503) for their retention time.
        self._removed: dict[tuple[str, str], float] = {}

    def hold(self, batch: Batch, now: float) -> None:
        key = (batch.site, batch.provider)
        held = Held(batch, now)
        self._latest[key] = held
        self._removed.pop(key, None)
        if batch.complete and batch.revision is not None:
            self._qualified[key] = held

    def remove(self, site: str, provider: str, now: float) -> None:
        """The provider left its site's config: forget it and announce the removal."""
        self.forget(site, provider)
        self._removed[(site, provider)] = now

    def removed(self, now: float, retention_s: float, *, site: str | None = None) -> tuple[SourceKey, ...]:
        """Removals announced within ``retention_s`` (older ones are dropped); ``site``
        limits them to one site (what a peer operator is sent)."""
        for key in [k for k, at in self._removed.items() if now - at > retention_s]:
            del self._removed[key]
        return tuple(SourceKey(s, p) for (s, p) in self._removed if site is None or s == site)

    def forget(self, site: str, provider: str) -> None:
        self._latest.pop((site, provider), None)
        self._qualified.pop((site, provider), None)

    def expire(self, now: float, ttl_s: float, *, keep_site: str | None = None) -> list[tuple[str, str]]:
        """Drop readings older than the signal TTL (a series the operator does not hold is
        absent, not 0). The operator's own site is kept: its batches refresh every pass and
        its failures travel as verdicts."""
        gone = [k for k, h in self._latest.items() if k[0] != keep_site and h.age_s(now) > ttl_s]
        for key in gone:
            self.forget(*key)
        return gone

    def latest(self) -> Iterator[tuple[Held, Held | None]]:
        """(latest batch, latest qualified batch) per provider."""
        for key, held in self._latest.items():
            yield held, self._qualified.get(key)

    def get(self, site: str, provider: str) -> Held | None:
        return self._latest.get((site, provider))

    def relay(self, now: float, *, site: str | None = None) -> tuple[Batch, ...]:
        """Whole batches, the original revision metadata untouched, the age increased by the
        time they were held. ``site`` limits it to one site (what a peer operator is sent)."""
        return tuple(
            with_added_age(h.batch, now - h.held_since)
            for (s, _), h in self._latest.items()
            if site is None or s == site
        )

    def relay_since(self, now: float, cursors: Iterable[Cursor], *,
                    site: str | None = None) -> tuple[tuple[Batch, ...], tuple[SourceKey, ...]]:
        """What a poll answer carries: ``relay`` less each batch the poller holds already
        (its cursor equals the batch's revision), named in ``unchanged`` instead (docs/wire.md:
        Cursors). A revision-less batch is always sent. Only the batches sent are copied
        with their added age, so an answer costs what changed, not what is held."""
        holds = {(c.site, c.provider): (c.publisher_epoch, c.batch_sequence) for c in cursors}
        sent: list[Batch] = []
        unchanged: list[SourceKey] = []
        for key, h in self._latest.items():
            if site is not None and key[0] != site:
                continue
            r = h.batch.revision
            if r is not None and holds and holds.get(key) == (r.publisher_epoch, r.batch_sequence):
                unchanged.append(SourceKey(*key))
            else:
                sent.append(with_added_age(h.batch, now - h.held_since))
        return tuple(sent), tuple(unchanged)

    def __len__(self) -> int:
        return len(self._latest)
