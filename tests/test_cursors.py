"""Gateway poll cursors (gridd/core/cursors.py) and the operator's answer to them
(Holdings.relay_since): what is left out, and that the gateway's store ends exactly as if
the unchanged batches had been re-sent."""

from __future__ import annotations

import msgspec
from support import WALL, BatchFeed, load, store

from gridd.core.batch import Cursor, SourceKey
from gridd.core.cursors import held_cursors, unchanged_batches
from gridd.core.holdings import Holdings
from gridd.core.readings import BatchOrder


def test_a_candidate_whose_fence_moved_past_its_batch_gets_no_cursor():
    feed, s = BatchFeed(), store()
    kept, other = feed.batch("b"), feed.batch("c")
    s.ingest([kept, other], now=1.0, now_wall=WALL)
    assert set(held_cursors(s.candidates, s.fences)) == {
        Cursor("b", "llama", kept.revision.publisher_epoch, 1),
        Cursor("c", "llama", other.revision.publisher_epoch, 1)}
    # A rejected payload advances b's fence (DESIGN 5b) but the store keeps the older batch:
    # a cursor would make the operator leave out a batch the gateway does not hold.
    rejected = feed.batch("b", ld=msgspec.structs.replace(load(), avg_running=-1.0))
    s.ingest([rejected, other], now=2.0, now_wall=WALL)
    assert s.fences.drops()["invalid"] == 1
    assert held_cursors(s.candidates, s.fences) == (Cursor("c", "llama", other.revision.publisher_epoch, 1),)


def test_unchanged_batches_are_admitted_as_the_repeat_a_resent_batch_was():
    feed = BatchFeed()
    first = [feed.batch("a"), feed.batch("b", age_s=0.5)]
    resent, cursor = store(), store()
    for s in (resent, cursor):
        s.ingest(first, now=1.0, now_wall=WALL)
    newer_a = feed.batch("a")
    # Old behaviour: b re-sent with its age grown by the operator's holding time.
    resent.ingest([newer_a, msgspec.structs.replace(first[1], age_s=1.5)], now=2.0, now_wall=WALL)
    # With cursors: b named unchanged, its held batch admitted again.
    repeated = unchanged_batches(cursor.candidates, [SourceKey("b", "llama"), SourceKey("gone", "x")])
    assert repeated == [first[1]]
    cursor.ingest([newer_a, *repeated], now=2.0, now_wall=WALL)
    for key in (("a", "llama"), ("b", "llama")):
        r, c = resent.candidates[key], cursor.candidates[key]
        assert (r.batch, r.received_at, r.age_s(30.0)) == (c.batch, c.received_at, c.age_s(30.0))
    assert resent.fences.drops() == cursor.fences.drops() and sum(cursor.fences.drops().values()) == 0
    assert cursor.candidates[("b", "llama")].age_s(2.0) == 1.5  # a repeat leaves the age unchanged


def test_relay_since_leaves_out_only_batches_at_the_cursor():
    feed, holdings = BatchFeed(), Holdings()
    a, b, c = feed.batch("a"), feed.batch("b"), feed.batch("c")
    verdict_only = msgspec.structs.replace(c, revision=None, complete=False, load=None,
                                           order=BatchOrder(c.revision.publisher_epoch, 1))
    for batch in (a, b, verdict_only):
        holdings.hold(batch, 10.0)
    epoch = a.revision.publisher_epoch
    cursors = [Cursor("a", "llama", epoch, 1), Cursor("b", "llama", epoch, 0), Cursor("c", "llama", epoch, 1)]
    sent, unchanged = holdings.relay_since(12.5, cursors)
    # b's cursor is behind its batch and c has no revision: both sent, aged by 2.5 s.
    assert [(x.site, x.age_s) for x in sent] == [("b", 2.5), ("c", 2.5)]
    assert unchanged == (SourceKey("a", "llama"),)
    assert holdings.relay_since(12.5, cursors, site="a") == ((), (SourceKey("a", "llama"),))
    assert holdings.relay_since(12.5, ())[0] == holdings.relay(12.5)  # no cursors: everything
