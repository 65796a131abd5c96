"""The publisher's label reads kept per Exposition.layout against the plain path.

ProviderPublisher.on_scrape keeps what its readers compute from names and labels alone (the
pools, the vLLM check, the EPP derivation's rows: gridd.core.derivation.EppPlan; the latency
window's rows: gridd.core.latency.LatencyPlan, VllmLatencyPlan for a vLLM source) while the
parse hands back the same layout object. Here two publishers scrape the same bodies: one as
the operator runs it, one whose expositions have their layout taken away, so every scrape
reads everything by label again
(the plain derive, kind_mismatch, pool_names and _snapshot). Their batches (msgpack bytes),
summaries, readiness and latency windows must be equal after every scrape.
"""

from __future__ import annotations

import itertools
import math
import pathlib
import random
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scrape_path_oracle import bodies as generated_bodies
from test_scrape_path_oracle import relabelled, revalued

import gridd.core.latency as latency
import gridd.core.publication as publication
from gridd.core.exposition import Exposition, SeriesCache, parse_exposition
from gridd.core.publication import ProviderPublisher

SAMPLES_DIR = pathlib.Path(__file__).parent / "data" / "samples"
SAMPLES = {path.name: path.read_text() for path in sorted(SAMPLES_DIR.glob("*.prom"))}
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
WALL = 1_800_000_000.0
VALUE = re.compile(r"(?m)^([^#\n][^\n]* )([^ \n]+)$")


def make(**config: object) -> ProviderPublisher:
    config.setdefault("model", MODEL)
    return ProviderPublisher(site="s", provider="p", provider_uid="u", generation=1,
                             publisher_epoch=1, created_at=0.0, next_sequence=itertools.count(1).__next__,
                             latency_min_completed=1, latency_window_s=5.0,
                             **config)  # type: ignore[arg-type]  # the test's configs hold the right types


@contextmanager
def plain_reads(plain: ProviderPublisher) -> Iterator[list[int]]:
    """Parses for ``plain`` come without a layout (its readers read every label again); the
    list yields how many parses of the other publisher came with one."""
    real = parse_exposition
    with_layout = [0]

    def parse(body: bytes, wanted: frozenset[str], series: SeriesCache, **options: int | None) -> Exposition:
        expo = real(body, wanted, series, **options)
        if series is plain._series:
            expo.layout = None
        elif expo.layout is not None:
            with_layout[0] += 1
        return expo

    with mock.patch.object(publication, "parse_exposition", parse):
        yield with_layout


def state(pub: ProviderPublisher) -> tuple[object, ...]:
    summary = pub.summary
    window = pub.latency
    return (*(repr(getattr(summary, slot)) for slot in summary.__slots__), pub.invalid_fields_changed,
            repr(pub.last_load), repr(pub.last_latency), pub.last_verdict, window.resets,
            window.snapshots_held, window.answered_on_last_observe, window.last_answer_at,
            pub.readiness.verdict(1e6, stale_after_s=5.0, unavailable=False))


def publish_both(bodies: list[str], *, reconfigured: dict[int, dict[str, object]] | None = None,
                 **config: object) -> int:
    """Scrape ``bodies`` with both publishers, reconfigured before the scrapes named in
    ``reconfigured`` (pool, kind, queue_full_at, adapters); the number of parses that had a
    layout."""
    reused, plain = make(**config), make(**config)
    with plain_reads(plain) as with_layout:
        for now, body in enumerate(bodies):
            if reconfigured and now in reconfigured:
                for pub in (reused, plain):
                    pub.reconfigure(model=pub.model, provider_uid="u", generation=now,
                                    **reconfigured[now])  # type: ignore[arg-type]  # config() types them
            batches = [pub.on_scrape(now=float(now), wall_now=WALL + now, body=body.encode(),
                                     failure_class=None, stale_after_s=5.0, unavailable=False)
                       for pub in (reused, plain)]
            encoded = [msgspec.msgpack.encode(batch) for batch in batches]
            assert encoded[0] == encoded[1], (now, batches)
            assert state(reused) == state(plain), now
    return with_layout[0]


COUNTER = re.compile(r"^[^{ ]*(_total|_count|_sum|_bucket)[{ ]")
ODD_VALUES = [math.nan, -1.0, -0.0, math.inf, -math.inf, 87.5, 1e308, 0.0]


def token(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    return "+Inf" if value == math.inf else "-Inf" if value == -math.inf else repr(value)


def revalue(body: str, rng: random.Random, step: int, odd: int = 0) -> str:
    """The body scraped again with every value changed, its lines otherwise the same (so the
    same layout): counters grow, gauges move (fractions stay within 0..1), and ``odd`` values
    become NaN, negative, infinite, huge or on a 0-100 scale."""
    def value(match: re.Match[str]) -> str:
        try:
            old = float(match.group(2))
        except ValueError:
            return match.group(0)
        if not math.isfinite(old):
            old = 0.0
        line = match.group(1)
        if COUNTER.match(line):
            new = old + rng.randrange(0, 4) * step
        elif "kv_cache" in line or "utilization" in line or "perc" in line:
            new = rng.random()
        else:
            new = float(rng.randrange(0, 20))
        return line + token(new)
    lines = VALUE.sub(value, body).split("\n")
    valued = [i for i, line in enumerate(lines) if VALUE.match(line)]
    for i in rng.sample(valued, min(odd, len(valued))):
        lines[i] = lines[i].rpartition(" ")[0] + " " + token(rng.choice(ODD_VALUES))
    return "\n".join(lines)


# The families the derivation and the latency window's sums read by label (an edit there
# changes what their plans hold; an odd value there takes their plain fallbacks).
DERIVED = re.compile(r"^(llm_d_epp_|inference_pool_|inference_extension_flow|inference_objective_)[a-z_]*"
                     r"(queue_size|ready|inflight_requests|average|duration_seconds_count|error_total|"
                     r"streaming_tpot_seconds_sum|streaming_tpot_seconds_count)")


def edited(body: str, rng: random.Random, edit: str) -> str:
    """The body with its layout changed: an endpoint renamed, a second pool added, the
    pool's rows removed, a line dropped, or replaced by another sample."""
    lines = body.split("\n")
    if edit == "rename":
        return body.replace("rank-0", "rank-9", rng.randrange(1, 6))
    if edit == "add_pool":
        extra = [line.replace('name="llama3-8b-pool"', 'name="extra-pool"') for line in lines
                 if 'name="llama3-8b-pool"' in line and not line.startswith("#")]
        return "\n".join(lines + extra)
    if edit == "drop_pool":
        pool = rng.choice(['name="llama3-8b-pool"', 'name="qwen3-32b-pool"', 'inference_pool="'])
        return "\n".join(line for line in lines if pool not in line)
    if edit == "mixed":  # an EPP's and an engine's series in one body: kind decides
        return body + "\n" + SAMPLES["vllm-direct.prom"]
    if edit == "drop_line":
        del lines[rng.randrange(len(lines))]
        return "\n".join(lines)
    if edit == "duplicate":  # a series of the derivation twice (first value wins, or adds up)
        derived = [i for i, line in enumerate(lines) if DERIVED.match(line)] or [0]
        at = rng.choice(derived)
        lines.insert(at + rng.randrange(2), lines[at])
        return "\n".join(lines)
    return SAMPLES[rng.choice(sorted(SAMPLES))]


def odd_values(body: str, rng: random.Random) -> str:
    """A few of the values the derivation and the latency sums read made NaN, negative,
    infinite, huge or 0-100 scale."""
    lines = body.split("\n")
    derived = [i for i, line in enumerate(lines) if DERIVED.match(line)]
    for i in rng.sample(derived, min(len(derived), rng.randrange(1, 4))):
        lines[i] = lines[i].rpartition(" ")[0] + " " + token(rng.choice(ODD_VALUES))
    return "\n".join(lines)


EDITS = ["values", "values", "values", "odd", "odd", "rename", "add_pool", "drop_pool", "drop_line",
         "duplicate", "duplicate", "mixed", "sample"]
CONFIGS = st.fixed_dictionaries({
    "kind": st.sampled_from(["auto", "epp", "vllm"]),
    "pool": st.sampled_from([None, "llama3-8b-pool", "qwen3-32b-pool", "extra-pool"]),
    "queue_full_at": st.sampled_from([None, 1.0, 2.0]),
    "adapters": st.sampled_from([(), ("Qwen/Qwen3-32B",)]),
})


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_a_sample_scraped_with_moving_values_publishes_as_the_plain_path(name: str) -> None:
    rng = random.Random(name)
    body = SAMPLES[name]
    sequence = [body]
    for step in range(1, 12):
        body = revalue(body, rng, step)
        sequence.append(body if step < 8 else odd_values(body, rng))
    for kind in ("auto", "epp", "vllm"):
        assert publish_both(sequence, kind=kind, queue_full_at=2.0) >= 9  # the layout came back


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(SAMPLES)), st.lists(st.sampled_from(EDITS), min_size=1, max_size=12),
       st.integers(0, 2**32), CONFIGS)
def test_samples_with_values_labels_and_pools_changing_publish_as_the_plain_path(
        name: str, edits: list[str], seed: int, config: dict[str, Any]) -> None:
    rng = random.Random(seed)  # a seed, not st.randoms: a body's values take hundreds of draws
    body = SAMPLES[name]
    sequence = [body, body]
    for step, edit in enumerate(edits, start=1):
        if edit == "values":
            body = revalue(body, rng, step, odd=rng.randrange(3))
        elif edit == "odd":
            body = odd_values(revalue(body, rng, step), rng)
        else:
            body = edited(body, rng, edit)
        sequence += [body, revalue(body, rng, step)]
    publish_both(sequence, **config)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(generated_bodies(), st.integers(0, 2**32), st.sampled_from(["auto", "epp", "vllm"]),
       st.sampled_from([None, "p"]))
def test_generated_bodies_publish_as_the_plain_path(body: str, seed: int, kind: str,
                                                    pool: str | None) -> None:
    """The oracle's generated bodies (odd labels, escapes, bucket runs, bad tokens), scraped
    again with new values and with labels edited."""
    rng = random.Random(seed)
    again = revalue(body, rng, 1, odd=1)
    sequence = [body, body, again, revalue(again, rng, 2, odd=2), revalued(body, rng),
                relabelled(body, rng) if body else body, revalue(body, rng, 3)]
    publish_both(sequence, kind=kind, pool=pool, queue_full_at=1.0, model="m")  # the oracle's model


def config(pool: str | None, kind: str = "auto", queue_full_at: float | None = 2.0,
           adapters: tuple[str, ...] = ()) -> dict[str, object]:
    return {"pool": pool, "kind": kind, "queue_full_at": queue_full_at, "adapters": adapters}


RELOADS = {
    "pools": {2: config("qwen3-32b-pool"), 4: config(None), 6: config("extra-pool"),
              8: config("llama3-8b-pool")},
    "kinds": {2: config(None, "epp"), 4: config(None, "vllm"), 6: config("llama3-8b-pool", "auto"),
              8: config("llama3-8b-pool", "epp")},
    "window": {3: config("llama3-8b-pool", adapters=("Qwen/Qwen3-32B",)),
               6: config("llama3-8b-pool", "auto", 1.0),
               8: config("qwen3-32b-pool", "epp", None, ("Qwen/Qwen3-32B",))},
}


@pytest.mark.parametrize("reloads", sorted(RELOADS))
@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_a_provider_reconfigured_between_scrapes_publishes_as_the_plain_path(name: str, reloads: str) -> None:
    """The kept reads hold for one pool and kind (and the latency window's for its models): a
    reload that changes them reads again."""
    rng = random.Random(name + reloads)
    body = SAMPLES[name]
    sequence = [body]
    for step in range(1, 10):
        body = revalue(body, rng, step, odd=rng.randrange(2))
        if step == 1:
            body = edited(body, rng, "mixed" if reloads == "kinds" else "add_pool")
        sequence.append(body)
    assert publish_both(sequence, reconfigured=RELOADS[reloads], pool="llama3-8b-pool") >= 4


@pytest.mark.parametrize("kind", ["auto", "vllm"])
def test_a_vllm_body_is_read_through_the_vllm_latency_plan(kind: str) -> None:
    """The vLLM cases above exercise VllmLatencyPlan: once its parses have a layout, the
    publisher sums the TTFT buckets without the plain _buckets (the plain one calls it on
    every scrape, the other only on its scrapes without a layout)."""
    rng = random.Random(kind)
    body = SAMPLES["vllm-direct.prom"]
    sequence = [body]
    for step in range(1, 10):
        body = revalue(body, rng, step)
        sequence.append(body)
    with mock.patch.object(latency, "_buckets", side_effect=latency._buckets) as plain_sums:
        with_layout = publish_both(sequence, kind=kind, queue_full_at=2.0)
    assert with_layout >= 7
    assert plain_sums.call_count == len(sequence) + (len(sequence) - with_layout)
