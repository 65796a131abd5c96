"""Provider probes (spec 004): pure extraction and aggregation with exact numbers, then the
runner and its sinks on trio's MockClock against the in-process simulator (vLLM flavour)."""

from __future__ import annotations

import itertools
import json
import logging
import math
import pathlib
import shutil

import httpx
import msgspec
import pytest
import trio
import trio.testing
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from gridd.config import load_config
from gridd.config_schema import AuthConfig, ExtractRule, ProviderConfig
from gridd.core.probes import Extractor, ProbeSeries, SlidingAggregate, extract, parse_number, regex_hazard
from gridd.core.publication import ProviderPublisher
from gridd.credentials import credentials_for
from gridd.operator.service import OperatorService
from gridd.probes.runner import ProbeRunner
from gridd.probes.sinks import JsonlHistory, metadata_key
from gridd.sim.app import SimApp
from gridd.sim.model import knobs_from

SPEC_REGEX = r"vllm:(num_requests_waiting)\{[^}]*\}\s+([0-9.eE+-]+)"
WILDCARD_REGEX = r"vllm:(num_requests_\w+)\{[^}]*\}\s+([0-9.eE+-]+)"
WALL0 = 1_800_000_000

VLLM_BODY = b"""\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3.5-9B"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3.5-9B"} 3.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3.5-9B"} 0.25
vllm:num_preemptions_total{engine="0",model_name="Qwen/Qwen3.5-9B"} 0.0
"""


def rx(pattern: str) -> ExtractRule:
    return ExtractRule(regex=pattern)


def js(path: str) -> ExtractRule:
    return ExtractRule(json=path)


# -- extract: table-driven ------------------------------------------------------------------------

EXTRACT_CASES = [
    ("spec regex on a vLLM body", VLLM_BODY, [rx(SPEC_REGEX)], {"num_requests_waiting": 3.0}),
    ("wildcard discovers several", VLLM_BODY, [rx(WILDCARD_REGEX)],
     {"num_requests_running": 1.0, "num_requests_waiting": 3.0}),
    ("json dotted path", b'{"stats": {"pending": 7}}', [js("stats.pending")], {"pending": 7.0}),
    ("two rules, in order", VLLM_BODY,
     [rx(SPEC_REGEX), rx(r"vllm:(kv_cache_usage_perc)\{[^}]*\}\s+([0-9.eE+-]+)")],
     {"num_requests_waiting": 3.0, "kv_cache_usage_perc": 0.25}),
    ("non-numeric values skipped", b"a=1 b=x c=NaN d=+Inf e=-1.5e3 f=1_000 g=. h=1e400 i=.5",
     [rx(r"(\w+)=(\S+)")], {"a": 1.0, "e": -1500.0, "i": 0.5}),
    ("last group is the value, the one before the name", b"vllm:waiting 4", [rx(r"(vllm):(\w+) (\d+)")],
     {"waiting": 4.0}),
    ("a name matched twice takes the last value",
     b'vllm:num_requests_waiting{engine="0"} 2.0\nvllm:num_requests_waiting{engine="1"} 5.0\n',
     [rx(SPEC_REGEX)], {"num_requests_waiting": 5.0}),
    ("a later rule overrides an earlier one", b'{"a": {"n": 1}, "b": {"n": 2}}', [js("a.n"), js("b.n")],
     {"n": 2.0}),
    ("a name group that did not take part is skipped", b"y=3 x=4", [rx(r"(?:(x)|y)=(\d)")], {"x": 4.0}),
    ("json: list index and float", b'{"data": [{"v": 1}, {"v": 2.5}]}', [js("data.1.v")], {"v": 2.5}),
    ("json: true is not a number", b'{"s": {"ok": true}}', [js("s.ok")], {}),
    ("json: a numeric string is not a number", b'{"s": {"n": "7"}}', [js("s.n")], {}),
    ("json: null, object, list leaves", b'{"a": null, "b": {}, "c": [1]}', [js("a"), js("b"), js("c")], {}),
    ("json: missing path", b'{"stats": {}}', [js("stats.pending")], {}),
    ("json: index out of range", b'{"d": [1]}', [js("d.3")], {}),
    ("json: not JSON", b"pending 7", [js("stats.pending")], {}),
    ("json: nested too deeply", b"[" * 100_000 + b"]" * 100_000, [js("0")], {}),
    ("json: integer beyond float range", b'{"n": 1' + b"0" * 400 + b"}", [js("n")], {}),
    ("json and regex rules on one body", b'{"stats": {"pending": 7}, "q": 9}',
     [js("stats.pending"), rx(r'"(q)": (\d+)')],
     {"pending": 7.0, "q": 9.0}),
    ("nothing matches", b"", [rx(SPEC_REGEX), js("a")], {}),
]


@pytest.mark.parametrize("body, rules, expected", [c[1:] for c in EXTRACT_CASES],
                         ids=[c[0] for c in EXTRACT_CASES])
def test_extract(body, rules, expected):
    assert extract(body, rules) == expected
    assert extract(body.decode("utf-8"), rules) == expected  # str in, same out


@pytest.mark.parametrize("junk", [b"garbage \xff\xfe{{{\n", b"vllm:num_requests_waiting{", b"\x00" * 10])
def test_extract_ignores_trailing_junk_and_bad_utf8(junk):
    assert extract(VLLM_BODY + junk, [rx(WILDCARD_REGEX)]) == {"num_requests_running": 1.0,
                                                               "num_requests_waiting": 3.0}


def test_extract_at_every_split_of_a_line_sees_only_whole_lines():
    # A body cut anywhere (the fetch never cuts one, but a backend may send a short body)
    # yields the series whose line is complete up to its value, never a wrong value.
    line = b'vllm:num_requests_waiting{engine="0"} 3.25\n'
    for cut in range(len(line) + 1):
        got = extract(line[:cut], [rx(SPEC_REGEX)])
        assert got in ({}, {"num_requests_waiting": 3.0}, {"num_requests_waiting": 3.2},
                       {"num_requests_waiting": 3.25}), (cut, got)
        assert (got == {"num_requests_waiting": 3.25}) == (cut >= len(line) - 1)


@pytest.mark.parametrize("text, expected", [
    ("3", 3.0), ("-0.5", -0.5), ("+2e3", 2000.0), (".25", 0.25), ("1.", 1.0), ("1e-3", 0.001),
    ("NaN", None), ("+Inf", None), ("-Inf", None), ("1e999", None), ("1_000", None), (" 1", None),
    ("", None), ("--1", None), ("e5", None), ("١", None), (None, None),
])
def test_parse_number(text, expected):
    assert parse_number(text) == expected


@pytest.mark.parametrize("pattern, hazardous", [
    (SPEC_REGEX, False),
    (WILDCARD_REGEX, False),
    (r"((a+)+)(b)", True),
    (r"((?:\w+_)*)(\d)", True),
    (r"((a{1,3})+)(b)", True),
    (r"(x)((?:a|b+)*)", True),
    (r"((?>a+)*)(b)", False),  # atomic: no backtracking into it
    (r"((?:a++)*)(b)", False),  # possessive inner
    (r"((\d+\.){3})(\d+)", False),  # bounded outer: polynomial at worst
    (r"(x)(\d+(?:\.\d+)?)", False),
])
def test_regex_hazard(pattern, hazardous):
    assert (regex_hazard(pattern) is not None) is hazardous


def test_a_refused_rule_is_skipped_and_the_others_still_run():
    extractor = Extractor([rx(r"((a+)+)(b)"), rx(SPEC_REGEX)])
    assert [index for index, _ in extractor.refused] == [0]
    assert extractor.extract(VLLM_BODY) == {"num_requests_waiting": 3.0}


def test_rules_compile_once_per_rule_set(monkeypatch):
    from gridd.core import probes

    built: list[tuple] = []

    class CountedExtractor(Extractor):
        def __init__(self, rules) -> None:
            built.append(tuple(rules))
            super().__init__(rules)

    monkeypatch.setattr(probes, "Extractor", CountedExtractor)
    rules = [rx(SPEC_REGEX + "(?#compiled once)")]  # a rule set no other test has compiled
    assert extract(VLLM_BODY, rules) == {"num_requests_waiting": 3.0}
    # an equal set: the same extractor
    assert extract(VLLM_BODY, list(rules)) == {"num_requests_waiting": 3.0}
    assert built == [tuple(rules)]


# -- aggregation: exact numbers ---------------------------------------------------------------------

SAMPLES = [4.0, 1.0, 3.0, 2.0, 10.0]  # window 4 holds [1, 3, 2, 10]; sorted [1, 2, 3, 10]


@pytest.mark.parametrize("method, expected", [
    ("latest", 10.0),
    ("mean", 4.0),
    ("median", 2.5),
    ("p50", 2.5),
    ("p90", 3 + 0.7 * 7),  # rank 0.9 * 3 = 2.7: between 3 and 10
    ("p95", 3 + 0.85 * 7),
    ("p99", 3 + 0.97 * 7),
    ("min", 1.0),
    ("max", 10.0),
    ("stdev", math.sqrt(50 / 3)),  # deviations -3 -1 -2 6 from the mean 4; n - 1 = 3
    # alpha = 2 / (4 + 1) = 0.4, seeded with the first sample, over every sample:
    # 4 -> 2.8 -> 2.88 -> 2.528 -> 5.5168
    ("ewma", 5.5168),
])
def test_sliding_aggregate(method, expected):
    agg = SlidingAggregate(4, method)
    for x in SAMPLES:
        agg.add(x)
    assert list(agg.samples) == [1.0, 3.0, 2.0, 10.0]
    assert agg.value() == pytest.approx(expected, rel=1e-12, abs=0)


def test_aggregate_edges():
    assert SlidingAggregate(20, "mean").value() is None  # no sample yet
    one = SlidingAggregate(20, "stdev")
    one.add(5.0)
    assert one.value() == 0.0
    assert SlidingAggregate(20, "ewma").alpha == 2 / 21
    huge = SlidingAggregate(2, "mean")
    huge.add(1.7e308)
    huge.add(1.7e308)
    assert huge.value() is None  # overflows: never published as a non-finite value
    wide = SlidingAggregate(2, "stdev")
    wide.add(-1e200)
    wide.add(1e200)
    assert wide.value() is None
    with pytest.raises(ValueError, match="unknown aggregate method"):
        SlidingAggregate(3, "sum")
    with pytest.raises(ValueError, match="at least 1 sample"):
        SlidingAggregate(0, "mean")


def test_probe_series_cap_and_forgetting():
    series = ProbeSeries(window=3, method="mean", max_series=2)
    first = series.observe({"a": 1.0, "b": 2.0, "c": 3.0})
    assert first.aggregates == {"a": 1.0, "b": 2.0} and first.dropped == 1
    second = series.observe({"c": 5.0, "a": 3.0, "d": 1.0})  # b is gone: its slot goes to c
    assert second.aggregates == {"a": 2.0, "c": 5.0} and second.dropped == 1
    third = series.observe({"a": 5.0, "c": 7.0})
    assert third.aggregates == {"a": 3.0, "c": 6.0} and third.dropped == 0
    assert len(series) == 2


# -- the runner against the simulator ---------------------------------------------------------------


class Recorder:
    """ASGI middleware: when each request reached the simulator (virtual time), and how."""

    def __init__(self, app) -> None:
        self.app = app
        self.requests: list[tuple[float, str, str, str, dict[str, str]]] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            headers = {k.decode(): v.decode() for k, v in scope["headers"]}
            self.requests.append((trio.current_time(), scope["method"], scope["path"],
                                  scope["query_string"].decode(), headers))
        await self.app(scope, receive, send)

    def times(self, query: str = "") -> list[float]:
        return [t for t, _, path, q, _ in self.requests if path == "/metrics" and q == query]


async def inline_io(fn, *args):
    """File IO on the event loop: autojump never leaps while a worker thread runs (tests only)."""
    return fn(*args)


def provider(probes: list[dict], *, endpoint: str = "http://sim/v1", enabled: bool = True,
             **settings) -> ProviderConfig:
    return msgspec.convert({"name": "llama", "model": "sim-model", "enabled": enabled,
                            "settings": {"endpoint": endpoint, "probes": probes, **settings}}, ProviderConfig)


def perf_probe(**fields) -> dict:
    return {"name": "perf", "endpoint": "http://sim/metrics", "interval": 5, "timeout": 5,
            "extract": [{"regex": SPEC_REGEX}], "aggregate": {"window": 3, "method": "mean"},
            "publish": [{"to": "metadata", "prefix": "performance"}], **fields}


class RunnerRig:
    def __init__(self, tmp_path: pathlib.Path, *, run_io=inline_io, **knobs) -> None:
        self.sim = SimApp(knobs_from({"flavour": "vllm", "endpoints": 1, **knobs}))
        self.recorder = Recorder(self.sim)
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.recorder))
        self.publisher = ProviderPublisher(site="a", provider="llama", model="sim-model", provider_uid="u",
                                           generation=1, publisher_epoch=1, created_at=0.0,
                                           next_sequence=itertools.count(1).__next__)
        self.workspace = tmp_path / "ws"
        self.runner = ProbeRunner(publisher={"llama": self.publisher}.get,
                                  resolve=lambda p: self.workspace / p, body_cap=lambda: 1024 * 1024,
                                  wall=lambda: WALL0 + trio.current_time(), run_io=run_io)

    def stats(self, name: str = "perf"):
        return self.runner.stats[("llama", name)]

    async def load(self, nursery: trio.Nursery, requests: int) -> None:
        await load(self.sim, nursery, requests)


async def load(sim: SimApp, nursery: trio.Nursery, requests: int) -> None:
    """``requests`` completions that hold the slots (max_seqs 1, long TTFT): with one endpoint
    the first runs and the rest wait."""

    async def complete() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=sim)) as c:
            await c.post("http://sim/v1/completions",
                         json={"model": "sim-model", "prompt": "x", "max_tokens": 2})

    for _ in range(requests):
        nursery.start_soon(complete)
    await trio.testing.wait_all_tasks_blocked()


async def test_ticks_start_to_start_on_a_fixed_schedule(tmp_path, autojump_clock):
    rig = RunnerRig(tmp_path, metrics_delay_s=1.5)  # every tick takes 1.5 s
    async with trio.open_nursery() as nursery:
        await nursery.start(rig.runner.run, rig.client, [provider([perf_probe()])])
        origin = trio.current_time()
        await trio.sleep_until(origin + 22)
        assert rig.recorder.times() == [origin + k * 5.0 for k in range(5)]  # 0 5 10 15 20: no drift
        assert rig.stats().ticks == 5 and rig.stats().skipped_ticks == 0 and rig.stats().failures == {}
        assert rig.stats().last_success_at == origin + 20 + 1.5
        nursery.cancel_scope.cancel()


async def test_a_tick_that_overruns_skips_the_missed_ticks(tmp_path, autojump_clock):
    rig = RunnerRig(tmp_path, metrics_hang=True)
    async with trio.open_nursery() as nursery:
        # timeout 8 > interval 5: each hanging tick ends at +8, past the grid point at +5
        await nursery.start(rig.runner.run, rig.client, [provider([perf_probe(timeout=8)])])
        origin = trio.current_time()
        await trio.sleep_until(origin + 29)
        assert rig.recorder.times() == [origin, origin + 10.0, origin + 20.0]  # never a burst
        stats = rig.stats()
        # each tick ran past one grid point: +5, +15 and +25 were skipped
        assert stats.failures == {"timeout": 3} and stats.skipped_ticks == 3
        assert stats.last_failure_at == origin + 20 + 8
        nursery.cancel_scope.cancel()


async def test_a_hanging_endpoint_is_a_failure_and_the_window_keeps_its_values(tmp_path, autojump_clock):
    rig = RunnerRig(tmp_path, max_seqs=1, ttft_s=3600)
    async with trio.open_nursery() as nursery:
        await rig.load(nursery, 3)  # 1 running, 2 waiting
        await nursery.start(rig.runner.run, rig.client, [provider([perf_probe(interval=10)])])
        origin = trio.current_time()
        await trio.sleep_until(origin + 1)
        assert rig.publisher.probes == {"performance.num_requests_waiting": 2.0}
        rig.sim.set_knobs(metrics_hang=True)
        await trio.sleep_until(origin + 14.999)  # the tick at +10 is still waiting
        assert rig.stats().failures == {}
        # ... and gives up at exactly +10 + timeout 5 (read just after: at +15 itself the test
        # and the probe wake together, in no fixed order)
        await trio.sleep_until(origin + 15.001)
        assert rig.stats().failures == {"timeout": 1} and rig.stats().last_failure_at == origin + 15
        assert rig.publisher.probes == {"performance.num_requests_waiting": 2.0}  # kept
        assert rig.stats().last_failure_class == "timeout"
        rig.sim.set_knobs(metrics_hang=False)
        await rig.load(nursery, 1)  # 3 waiting now
        await trio.sleep_until(origin + 21)
        # window 3 holds [2, 3]: the failed tick added nothing and removed nothing
        assert rig.publisher.probes == {"performance.num_requests_waiting": 2.5}
        assert rig.stats().ticks == 3 and rig.stats().last_failure_class is None
        nursery.cancel_scope.cancel()


async def test_failing_probes_keep_ticking_beside_a_healthy_one(tmp_path, autojump_clock):
    rig = RunnerRig(tmp_path)
    probes = [perf_probe(name="perf"),
              perf_probe(name="nomatch", extract=[{"regex": r"(nothing)=(\d+)"}]),
              perf_probe(name="missing", endpoint="http://sim/nowhere")]
    async with trio.open_nursery() as nursery:
        await nursery.start(rig.runner.run, rig.client, [provider(probes)])
        origin = trio.current_time()
        await trio.sleep_until(origin + 16)
        assert rig.stats("perf").failures == {}
        assert rig.stats("nomatch").failures == {"extract": 4}  # a 2xx body with nothing to extract
        assert rig.stats("missing").failures == {"http_status": 4}  # 404
        assert rig.stats("missing").last_failure_detail == "HTTP 404"
        assert all(rig.stats(n).ticks == 4 for n in ("perf", "nomatch", "missing"))
        assert rig.publisher.probes == {"performance.num_requests_waiting": 0.0}
        nursery.cancel_scope.cancel()


async def test_the_body_cap_applies_to_probes(tmp_path, autojump_clock):
    rig = RunnerRig(tmp_path, huge_body=True)
    async with trio.open_nursery() as nursery:
        await nursery.start(rig.runner.run, rig.client, [provider([perf_probe()])])
        await trio.sleep(1)
        assert rig.stats().failures == {"body_cap": 1}
        nursery.cancel_scope.cancel()


async def test_max_series_drops_new_names_and_counts_them(tmp_path, autojump_clock):
    rig = RunnerRig(tmp_path)
    probe = perf_probe(extract=[{"regex": WILDCARD_REGEX}], max_series=1)
    async with trio.open_nursery() as nursery:
        await nursery.start(rig.runner.run, rig.client, [provider([probe])])
        origin = trio.current_time()
        await trio.sleep_until(origin + 11)
        assert rig.publisher.probes == {"performance.num_requests_running": 0.0}  # first in the body
        assert rig.stats().dropped_series == 3 and rig.stats().series == 1  # waiting, once per tick
        nursery.cancel_scope.cancel()


async def test_method_and_credentials(tmp_path, autojump_clock):
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, str(request.url), request.headers.get("authorization")))
        return httpx.Response(200, text="q 4\n")

    rig = RunnerRig(tmp_path)
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    auth = {"auth": {"scheme": "bearer", "api_key": "s3cret"}}
    own = perf_probe(name="own", endpoint="http://backend:8000/metrics", method="POST",
                     extract=[{"regex": r"(q) (\d+)"}])
    other = perf_probe(name="other", endpoint="http://elsewhere:8000/metrics",
                       extract=[{"regex": r"(q) (\d+)"}])
    async with trio.open_nursery() as nursery:
        providers = [provider([own, other], endpoint="http://backend:8000/v1", **auth)]
        await nursery.start(rig.runner.run, client, providers)
        await trio.sleep(1)
        assert sorted(seen) == [("GET", "http://elsewhere:8000/metrics", None),
                                ("POST", "http://backend:8000/metrics", "Bearer s3cret")]
        assert rig.stats("own").failures == {} and rig.publisher.probes == {"performance.q": 4.0}
        nursery.cancel_scope.cancel()


def test_credentials_go_to_the_providers_origin_only():
    p = provider([], endpoint="https://backend:8443/v1",
                 auth={"scheme": "header", "api_key": "k", "header_name": "x-key",
                       "custom_headers": {"x-a": "1"}})
    assert credentials_for("https://backend:8443/metrics", None, p) == {"x-a": "1", "x-key": "k"}
    assert credentials_for("http://backend:8443/metrics", None, p) == {}  # another scheme
    assert credentials_for("https://backend:9090/metrics", None, p) == {}  # another port
    assert credentials_for("https://other:8443/metrics", None, p) == {}
    # A URL's own auth block is what it gets, whatever its origin.
    own = AuthConfig(scheme="bearer", api_key="probe-key")
    assert credentials_for("https://other:8443/metrics", own, p) == {"authorization": "Bearer probe-key"}
    # The default port counts as written: https://backend is https://backend:443.
    q = provider([], endpoint="https://backend/v1", auth={"scheme": "bearer", "api_key": "k"})
    assert credentials_for("https://backend:443/metrics", None, q) == {"authorization": "Bearer k"}


# -- the JSONL file sink ----------------------------------------------------------------------------


def records(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_file_sink_appends_records_and_keeps_the_newest_max_entries(tmp_path, autojump_clock):
    rig = RunnerRig(tmp_path, max_seqs=1, ttft_s=3600)
    probe = perf_probe(publish=[{"to": "metadata", "prefix": "performance"},
                                {"to": "file", "path": "probes/local.perf.jsonl", "max_entries": 3}],
                       aggregate={"window": 2, "method": "latest"})
    path = rig.workspace / "probes" / "local.perf.jsonl"  # workspace-relative; the directory is created
    async with trio.open_nursery() as nursery:
        await nursery.start(rig.runner.run, rig.client, [provider([probe])])
        origin = trio.current_time()
        counts = []
        for k in range(9):
            await trio.sleep_until(origin + 5 * k + 1)
            counts.append(len(path.read_text().splitlines()))
            if k == 6:
                await rig.load(nursery, 2)  # 1 waiting from the tick at +35
        # max_entries 3, slack max(1, 3 // 10) = 1: the file grows to 4 records, and the
        # append that makes it 5 rewrites it with the newest 3.
        assert counts == [1, 2, 3, 4, 3, 4, 3, 4, 3]
        assert records(path) == [
            {"ts": WALL0 + origin + 30, "provider": "llama", "probe": "perf",
             "aggregates": {"num_requests_waiting": 0.0}},
            {"ts": WALL0 + origin + 35, "provider": "llama", "probe": "perf",
             "aggregates": {"num_requests_waiting": 1.0}},
            {"ts": WALL0 + origin + 40, "provider": "llama", "probe": "perf",
             "aggregates": {"num_requests_waiting": 1.0}},
        ]
        assert rig.runner.histories[path].compactions == 3
        nursery.cancel_scope.cancel()


async def test_file_sink_unbounded_with_max_entries_0(tmp_path, autojump_clock):
    rig = RunnerRig(tmp_path)
    probe = perf_probe(publish=[{"to": "file", "path": str(rig.workspace / "abs.jsonl"), "max_entries": 0}],
                       interval=1)
    async with trio.open_nursery() as nursery:
        await nursery.start(rig.runner.run, rig.client, [provider([probe])])
        await trio.sleep(30.5)
        nursery.cancel_scope.cancel()
    # an absolute path inside the workspace is used as it is
    assert len(records(rig.workspace / "abs.jsonl")) == 31


async def test_file_sink_io_error_is_counted_logged_once_and_never_stops_the_probe(
        tmp_path, autojump_clock, caplog):
    rig = RunnerRig(tmp_path)
    rig.workspace.mkdir()
    (rig.workspace / "probes").write_text("a file where the directory should be")
    probe = perf_probe(publish=[{"to": "file", "path": "probes/x.jsonl"},
                                {"to": "metadata", "prefix": "performance"}])
    caplog.set_level(logging.WARNING, logger="gridd.probes")
    async with trio.open_nursery() as nursery:
        await nursery.start(rig.runner.run, rig.client, [provider([probe])])
        origin = trio.current_time()
        await trio.sleep_until(origin + 11)
        assert rig.stats().sink_errors == {"file": 3}
        assert rig.stats().ticks == 3 and rig.stats().failures == {}
        assert rig.publisher.probes == {"performance.num_requests_waiting": 0.0}  # later sinks still run
        assert len([r for r in caplog.records if "file sink failed" in r.getMessage()]) == 1
        nursery.cancel_scope.cancel()


async def test_jsonl_history_in_a_worker_thread_counts_existing_lines_and_mends_a_partial_one(
        tmp_path, autojump_clock):
    # Real worker threads: hold virtual time still while they run (STYLE 13 / tests/test_operator.py).
    autojump_clock.autojump_threshold = math.inf
    path = tmp_path / "deep" / "er" / "h.jsonl"
    path.parent.mkdir(parents=True)
    path.write_bytes(b'{"n": 1}\n{"n": 2}\n{"n": 3')  # a crash cut the last record short
    history = JsonlHistory(path, max_entries=4, run_io=trio.to_thread.run_sync)
    await history.append(b'{"n": 4}\n')
    assert history.lines == 4
    assert path.read_bytes() == b'{"n": 1}\n{"n": 2}\n{"n": 3\n{"n": 4}\n'
    await history.append(b'{"n": 5}\n')  # 5 = 4 + slack 1: kept
    await history.append(b'{"n": 6}\n')  # 6: rewritten with the newest 4
    assert path.read_bytes() == b'{"n": 3\n{"n": 4}\n{"n": 5}\n{"n": 6}\n'
    assert history.lines == 4 and history.compactions == 1
    fresh = JsonlHistory(tmp_path / "new" / "dir" / "h.jsonl", max_entries=10, run_io=trio.to_thread.run_sync)
    await fresh.append(b"{}\n")
    assert (tmp_path / "new" / "dir" / "h.jsonl").read_bytes() == b"{}\n"


async def test_jsonl_history_recounts_after_an_error(tmp_path, autojump_clock):
    path = tmp_path / "h.jsonl"
    history = JsonlHistory(path, max_entries=2, run_io=inline_io)
    await history.append(b"1\n")
    path.unlink()
    path.mkdir()  # now unwritable as a file
    with pytest.raises(OSError):
        await history.append(b"2\n")
    assert history.lines is None
    path.rmdir()
    path.write_bytes(b"a\nb\nc\n")  # someone else wrote it meanwhile
    await history.append(b"d\n")  # recounted: 4 > 2 + 1, so rewritten to the newest 2
    assert path.read_bytes() == b"c\nd\n" and history.lines == 2


# -- through the operator: batches, reloads, drain, status, metrics --------------------------------

OPERATOR_CONFIG = """
role: operator
site: a
state_dir: state
providers:
  - name: llama
    model: sim-model
    metrics: {{url: "http://sim/metrics", timeout_s: 2}}
    settings:
      endpoint: "http://sim/v1"
      probes:
{probes}
"""

PROBE_YAML = """\
        - name: {name}
          endpoint: "http://sim/metrics?probe={name}"
          interval: {interval}
          enabled: {enabled}
          extract: [{{regex: '{regex}'}}]
          aggregate: {{window: 2, method: latest}}
          publish: [{{to: metadata, prefix: {prefix}}}]
"""


def operator_yaml(*probes: dict) -> str:
    text = "".join(PROBE_YAML.format(**{"interval": 5, "enabled": "true", "regex": SPEC_REGEX,
                                        "prefix": "performance", **p}) for p in probes)
    return OPERATOR_CONFIG.format(probes=text)


class OperatorRig:
    def __init__(self, tmp_path: pathlib.Path, text: str, **knobs) -> None:
        self.config = tmp_path / "operator.yaml"
        self.config.write_text(text)
        self.sim = SimApp(knobs_from({"flavour": "vllm", "endpoints": 1, **knobs}))
        self.recorder = Recorder(self.sim)
        self.registry = CollectorRegistry()
        self.operator = OperatorService(
            load_config(self.config, env={}), self.registry,
            client=httpx.AsyncClient(transport=httpx.ASGITransport(app=self.sim)),
            probe_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=self.recorder)),
            wall=lambda: WALL0 + trio.current_time(), probe_io=inline_io)

    def latest(self):
        return self.operator.holdings.get("a", "llama").batch

    def sample(self, name: str, probe: str, **labels):
        return self.registry.get_sample_value(
            name, {"grid_site": "a", "grid_provider": "llama", "probe": probe, **labels})

    async def start(self, nursery: trio.Nursery, clock) -> float:
        """Start the operator (its start-up works in worker threads: virtual time held)."""
        clock.autojump_threshold = math.inf
        await nursery.start(self.operator.run)
        clock.autojump_threshold = 0
        return trio.current_time()

    async def reload(self, clock, text: str) -> None:
        # stage() works in a worker thread: hold virtual time still meanwhile.
        self.config.write_text(text)
        clock.autojump_threshold = math.inf
        self.operator.commit(await self.operator.stage(load_config(self.config, env={})))
        clock.autojump_threshold = 0


async def test_probe_values_travel_in_the_next_batch(tmp_path, autojump_clock):
    rig = OperatorRig(tmp_path, operator_yaml({"name": "perf"}), max_seqs=1, ttft_s=3600)
    async with trio.open_nursery() as nursery:
        await load(rig.sim, nursery, 4)  # 1 running, 3 waiting
        # scrape passes at +0, +1, ...; probe ticks at +0, +5, ...
        origin = await rig.start(nursery, autojump_clock)
        await trio.sleep_until(origin + 1.5)
        batch = rig.latest()
        assert batch.probes == {"performance.num_requests_waiting": 3.0}
        assert batch.complete is True
        assert rig.sample("grid_probe_ticks_total", "perf") == 1.0
        assert rig.sample("grid_probe_series", "perf") == 1.0
        status = rig.operator.status()["providers"][0]["probes"][0]
        assert status["name"] == "perf" and status["state"] == "ok" and status["series"] == 1
        assert status["last_success_age_s"] == 1.5 and status["failures"] == {}
        body = generate_latest(rig.registry)
        nursery.cancel_scope.cancel()
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool not found: install Debian's 'prometheus' package (scripts/bootstrap does)")
    assert b'grid_probe_ticks_total{grid_provider="llama",grid_site="a",probe="perf"} 1.0' in body
    proc = await trio.run_process([promtool, "check", "metrics"], stdin=body, capture_stdout=True,
                                  capture_stderr=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


async def test_reload_restarts_only_the_changed_probe_and_stops_a_disabled_one(tmp_path, autojump_clock):
    probes = [{"name": "a"}, {"name": "b"}, {"name": "c", "prefix": "attributes.probe"}]
    rig = OperatorRig(tmp_path, operator_yaml(*probes))
    async with trio.open_nursery() as nursery:
        origin = await rig.start(nursery, autojump_clock)
        await trio.sleep_until(origin + 12.5)
        runner = rig.operator.probes
        task_a = runner.tasks[("llama", "a")]
        assert set(rig.operator.publishers["llama"].probes) == {"performance.num_requests_waiting",
                                                                "probe.num_requests_waiting"}
        await rig.reload(autojump_clock, operator_yaml(
            {"name": "a"}, {"name": "b", "interval": 4},
            {"name": "c", "enabled": "false", "prefix": "attributes.probe"}))
        reloaded = trio.current_time()
        assert reloaded == origin + 12.5
        assert runner.tasks[("llama", "a")] is task_a  # untouched: same task, same window
        assert ("llama", "c") not in runner.tasks
        # c's values leave the provider's metadata at the commit, before any later batch
        assert set(rig.operator.publishers["llama"].probes) == {"performance.num_requests_waiting"}
        await trio.sleep_until(origin + 25.5)
        assert rig.recorder.times("probe=a") == [origin + k * 5.0 for k in range(6)]  # 0 .. 25, unbroken
        # 12.5 16.5 20.5 24.5 after the reload
        assert rig.recorder.times("probe=b") == [origin, origin + 5.0, origin + 10.0,
                                                 *(reloaded + k * 4.0 for k in range(4))]
        assert rig.recorder.times("probe=c") == [origin, origin + 5.0, origin + 10.0]
        assert runner.stats[("llama", "b")].ticks == 7 and runner.stats[("llama", "b")].restarts == 1
        assert rig.sample("grid_probe_ticks_total", "b") == 7.0
        assert rig.sample("grid_probe_ticks_total", "c") is None  # not running: no series
        states = {p["name"]: p["state"] for p in rig.operator.status()["providers"][0]["probes"]}
        assert states == {"a": "ok", "b": "ok", "c": "disabled"}
        assert "probe.num_requests_waiting" not in rig.latest().probes
        nursery.cancel_scope.cancel()


async def test_provider_endpoint_change_restarts_a_probe_that_uses_it(tmp_path, autojump_clock):
    probe_endpoint = '          endpoint: "http://sim/metrics?probe=perf"\n'
    text = operator_yaml({"name": "perf"}).replace(probe_endpoint, "")
    rig = OperatorRig(tmp_path, text)
    async with trio.open_nursery() as nursery:
        origin = await rig.start(nursery, autojump_clock)
        await trio.sleep_until(origin + 2)
        assert rig.operator.probes.tasks[("llama", "perf")].spec.url == "http://sim/v1"
        # /v1 is no /metrics
        assert rig.operator.probes.stats[("llama", "perf")].failures == {"http_status": 1}
        await rig.reload(autojump_clock,
                         text.replace('endpoint: "http://sim/v1"', 'endpoint: "http://sim/metrics"'))
        await trio.sleep_until(origin + 2.5)
        stats = rig.operator.probes.stats[("llama", "perf")]
        assert stats.restarts == 1 and stats.ticks == 2 and stats.last_failure_class is None
        nursery.cancel_scope.cancel()


async def test_drain_stops_every_probe(tmp_path, autojump_clock):
    rig = OperatorRig(tmp_path, operator_yaml({"name": "a"}, {"name": "b"}))
    async with trio.open_nursery() as nursery:
        origin = await rig.start(nursery, autojump_clock)
        await trio.sleep_until(origin + 6)
        await rig.operator.drain()
        await trio.sleep_until(origin + 30)
        assert rig.recorder.times("probe=a") == [origin, origin + 5.0]
        assert rig.recorder.times("probe=b") == [origin, origin + 5.0]
        assert rig.operator.probes.tasks == {}
        assert [p["running"] for p in rig.operator.status()["providers"][0]["probes"]] == [False, False]
        nursery.cancel_scope.cancel()


async def test_a_bug_in_a_tick_is_counted_and_the_probe_goes_on(tmp_path, autojump_clock, caplog):
    rig = RunnerRig(tmp_path)

    def broken() -> int:
        raise RuntimeError("boom")

    rig.runner.body_cap = broken
    caplog.set_level(logging.ERROR, logger="gridd.probes")
    async with trio.open_nursery() as nursery:
        await nursery.start(rig.runner.run, rig.client, [provider([perf_probe()])])
        origin = trio.current_time()
        await trio.sleep_until(origin + 11)
        assert rig.stats().failures == {"internal": 3} and rig.stats().ticks == 3
        assert len([r for r in caplog.records if "tick failed" in r.getMessage()]) == 3
        nursery.cancel_scope.cancel()


def test_a_quadratic_regex_on_a_hostile_body_times_out_instead_of_blocking():
    import time as _time

    from gridd.config_schema import ExtractRule
    from gridd.core.probes import Extractor, ExtractTimeout

    extractor = Extractor([ExtractRule(regex=r"(\w+)\s+(\d+)")])  # passes the static hazard check
    started = _time.perf_counter()
    with pytest.raises(ExtractTimeout):
        extractor.extract(b"a" * 262_144, budget_s=0.2)
    assert _time.perf_counter() - started < 2.0  # the stdlib engine needed ~10 minutes here
    assert extractor.extract(b"waiting 3\n", budget_s=0.2) == {"waiting": 3.0}


def test_a_file_sink_cannot_target_gridds_own_files(tmp_path):
    from gridd.config import load_config
    from gridd.errors import ConfigError
    from gridd.probes.sinks import check_sink_paths

    def config_with(path: str):
        (tmp_path / "op.yaml").write_text(f"""
role: operator
site: a
state_dir: state
providers:
  - name: p
    model: m
    settings:
      endpoint: "http://127.0.0.1:9/v1"
      probes: [{{name: perf, extract: [{{json: a.b}}], publish: [{{to: file, path: "{path}"}}]}}]
""")
        return load_config(tmp_path / "op.yaml", env={})

    check_sink_paths(config_with("probes/perf.jsonl"))  # an ordinary history file
    check_sink_paths(config_with(str(tmp_path / "probes" / "abs.jsonl")))  # absolute, inside the workspace
    for own in ("op.yaml", "state/providers.json", "state", "./state/op.yaml"):
        with pytest.raises(ConfigError, match=r"publish\[0\]\.path: .* would write over gridd's own files"):
            check_sink_paths(config_with(own))


def test_file_sinks_live_under_the_workspace(tmp_path):
    """docs/security.md: the issue's overwrite of any file the daemon can write (a sink at
    /some/other/file with max_entries 1) is refused at start, reload and API write."""
    from gridd.config import load_config
    from gridd.errors import ConfigError
    from gridd.probes.sinks import check_sink_paths

    ws = tmp_path / "ws"
    ws.mkdir()
    (tmp_path / "victim").write_text("precious\n")
    (ws / "out").symlink_to(tmp_path)  # a symlink out of the workspace

    def config_with(path: str):
        (ws / "op.yaml").write_text(f"""
role: operator
site: a
providers:
  - name: p
    model: m
    settings:
      endpoint: "http://127.0.0.1:9/v1"
      probes:
        - {{name: perf, extract: [{{json: a.b}}], publish: [{{to: file, path: "{path}", max_entries: 1}}]}}
""")
        return load_config(ws / "op.yaml", env={})

    for outside in (str(tmp_path / "victim"), "/etc/passwd", "out/victim", str(ws / "out" / "victim")):
        with pytest.raises(ConfigError, match=r"publish\[0\]\.path: .* is outside the workspace"):
            check_sink_paths(config_with(outside))
    for dotdot in ("../victim", "probes/../../victim", "probes/../x.jsonl"):
        with pytest.raises(ConfigError, match=r"publish\[0\]\.path: '\.\.' is not allowed"):
            config_with(dotdot)
    assert (tmp_path / "victim").read_text() == "precious\n"


async def test_a_sink_directory_swapped_for_a_symlink_is_refused_at_append(tmp_path):
    from gridd.probes.sinks import JsonlHistory

    ws = tmp_path / "ws"
    (ws / "probes").mkdir(parents=True)
    history = JsonlHistory(ws / "probes" / "h.jsonl", max_entries=10, run_io=inline_io, root=ws)
    await history.append(b"{}\n")
    (ws / "probes" / "h.jsonl").unlink()
    (ws / "probes").rmdir()
    (ws / "probes").symlink_to(tmp_path)  # swapped after the config was checked
    with pytest.raises(OSError, match="leads outside the workspace"):
        await history.append(b"{}\n")
    assert not (tmp_path / "h.jsonl").exists()


async def test_a_sink_path_that_is_not_a_regular_file_is_an_io_error_not_a_hang(tmp_path):
    import os as _os

    from gridd.probes.sinks import JsonlHistory

    fifo = tmp_path / "fifo.jsonl"
    _os.mkfifo(fifo)
    for target in (fifo, pathlib.Path("/dev/zero")):
        history = JsonlHistory(target, max_entries=10, run_io=lambda fn, *a: fn(*a))
        with trio.fail_after(5), pytest.raises(OSError):
            await history.append(b'{"x": 1}\n')


async def test_a_probe_only_provider_is_published_every_scrape_interval_with_value_ages(
        tmp_path, autojump_clock):
    # Spec 004 Example 1: no metrics block. Before, nothing ever published such a provider.
    metrics_block = '    metrics: {url: "http://sim/metrics", timeout_s: 2}\n'
    text = operator_yaml({"name": "perf"}).replace(metrics_block, "")
    rig = OperatorRig(tmp_path, text, max_seqs=1, ttft_s=3600)
    async with trio.open_nursery() as nursery:
        await load(rig.sim, nursery, 3)  # 1 running, 2 waiting
        origin = await rig.start(nursery, autojump_clock)  # passes at +0, +1, ...; probe ticks at +0, +5
        await trio.sleep_until(origin + 3.5)
        batch = rig.latest()
        assert (batch.ready, batch.ready_reason, batch.load, batch.revision) == (
            None, "NoMetricsSource", None, None)
        assert batch.probes == {"performance.num_requests_waiting": 2.0}
        # published by the pass at +3; the value was produced by the tick at +0
        assert batch.probe_age_s == {"performance.num_requests_waiting": 3.0}
        assert batch.order.batch_sequence == 4  # one per pass: +0 .. +3
        status = rig.operator.status()["providers"][0]
        assert (status["ready"], status["reason"]) == (None, "NoMetricsSource")
        assert status["metadata"] == {"performance.num_requests_waiting": 2.0}
        assert status["metadata_age_s"] == {"performance.num_requests_waiting": 3.5}
        rig.sim.set_knobs(metrics_hang=True)  # the tick at +5 fails: the value is kept, and ages
        await trio.sleep_until(origin + 12.5)
        assert rig.latest().probes == {"performance.num_requests_waiting": 2.0}
        assert rig.latest().probe_age_s == {"performance.num_requests_waiting": 12.0}
        # its last probe disabled: no longer published (nothing current to relay)
        await rig.reload(autojump_clock, text.replace("enabled: true", "enabled: false"))
        assert rig.operator.holdings.get("a", "llama") is None
        nursery.cancel_scope.cancel()


def test_the_default_prefix_surfaces_as_probe_name():
    assert metadata_key("attributes.probe", "x") == "probe.x"  # spec 004, Prefixes
    assert metadata_key("attributes", "x") == "x"
    assert metadata_key("performance", "x") == "performance.x"
    assert metadata_key("attributesx", "x") == "attributesx.x"
    assert metadata_key("", "x") == "x"
