"""gridd.core.exposition: the Prometheus text parser, tested three ways (h11 tests/test_io.py).

Each table case is checked on the whole body (as bytes, str and with CRLF endings), cut at
every byte, and with trailing junk. Then: the reference samples, the `wanted` filter,
prometheus_client as an oracle on generated valid expositions, and the fast paths
against the full grammar (`_parse_line`) on generated near-miss lines.
"""

from __future__ import annotations

import math
import pathlib
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from gridd.core import exposition, exposition_scan
from gridd.core.exposition import Exposition, _parse_line, parse_exposition

NAN = "NaN"  # stands for any NaN when comparing values


def comparable(exposition: Exposition) -> tuple[dict[str, list[tuple[dict[str, str], object]]], int]:
    """Samples and malformed count, with NaN values made comparable."""
    samples = {
        name: [(labels, NAN if math.isnan(value) else value) for labels, value in series]
        for name, series in exposition.samples.items()
    }
    return samples, exposition.malformed_lines


def merged(*parts: Exposition) -> tuple[dict[str, list[tuple[dict[str, str], object]]], int]:
    """What parsing the concatenated lines of `parts` must give: lines are independent."""
    samples: dict[str, list[tuple[dict[str, str], object]]] = {}
    malformed = 0
    for part in parts:
        part_samples, part_malformed = comparable(part)
        for name, series in part_samples.items():
            samples.setdefault(name, []).extend(series)
        malformed += part_malformed
    return samples, malformed


# (id, body, expected samples, expected malformed lines). Bodies are bytes; the id says
# what the case is about.
M = "llm_d_epp_ready_endpoints"
CASES: list[tuple[str, bytes, dict[str, list[tuple[dict[str, str], object]]], int]] = [
    ("empty", b"", {}, 0),
    ("blank-lines", b"\n\n  \n\t\n", {}, 0),
    ("bare-sample", b"go_goroutines 412\n", {"go_goroutines": [({}, 412.0)]}, 0),
    ("one-label", b'%s{name="p"} 4\n' % M.encode(), {M: [({"name": "p"}, 4.0)]}, 0),
    ("no-final-newline", b'%s{name="p"} 4' % M.encode(), {M: [({"name": "p"}, 4.0)]}, 0),
    (
        "help-type-comments",
        b"# HELP %s [ALPHA] The number {of} ready endpoints.\n# TYPE %s gauge\n"
        b'# just a comment\n  # indented comment\n#\n%s{name="p"} 4\n' % (M.encode(), M.encode(), M.encode()),
        {M: [({"name": "p"}, 4.0)]},
        0,
    ),
    ("empty-label-set", b"up{} 1\n", {"up": [({}, 1.0)]}, 0),
    ("empty-label-set-blanks", b"up{ \t} 1\n", {"up": [({}, 1.0)]}, 0),
    ("trailing-comma", b'up{a="1",} 1\n', {"up": [({"a": "1"}, 1.0)]}, 0),
    ("trailing-comma-blanks", b'up{a="1" , } 1\n', {"up": [({"a": "1"}, 1.0)]}, 0),
    ("blanks-in-labels", b'up { a = "1" ,\tb="2" } 1\n', {"up": [({"a": "1", "b": "2"}, 1.0)]}, 0),
    ("no-blank-after-brace", b'up{a="1"}7\n', {"up": [({"a": "1"}, 7.0)]}, 0),
    (
        "escaped-quote-backslash-newline",
        b'x{v="say \\"hi\\"",w="C:\\\\dir\\\\",n="a\\nb",t="\\\\n"} 1\n',
        {"x": [({"v": 'say "hi"', "w": "C:\\dir\\", "n": "a\nb", "t": "\\n"}, 1.0)]},
        0,
    ),
    (
        "brace-comma-equals-in-value",
        b'x{a="}",b=",",c="a=\\"b\\",c}",d="{\\"k\\": 1}"} 2\n',
        {"x": [({"a": "}", "b": ",", "c": 'a="b",c}', "d": '{"k": 1}'}, 2.0)]},
        0,
    ),
    ("empty-value", b'x{a=""} 3\n', {"x": [({"a": ""}, 3.0)]}, 0),
    (
        "unicode-value-and-line-breaks",
        'x{model="Llama-3 \u00e9\u4e2d",sep="a\u2028b\x85c\x0bd\x1ce\rf"} 1\n'.encode(),
        {"x": [({"model": "Llama-3 \u00e9\u4e2d", "sep": "a\u2028b\x85c\x0bd\x1ce\rf"}, 1.0)]},
        0,
    ),
    (
        "special-floats",
        b"v 1\nv NaN\nv nan\nv +Inf\nv -Inf\nv Inf\nv -inf\nv 1e+06\nv 1.048576e+06\n"
        b"v -2.5E-3\nv .5\nv 5.\nv 0\nv -0\n",
        {
            "v": [
                ({}, 1.0),
                ({}, NAN),
                ({}, NAN),
                ({}, math.inf),
                ({}, -math.inf),
                ({}, math.inf),
                ({}, -math.inf),
                ({}, 1e6),
                ({}, 1048576.0),
                ({}, -0.0025),
                ({}, 0.5),
                ({}, 5.0),
                ({}, 0.0),
                ({}, -0.0),
            ]
        },
        0,
    ),
    (
        "timestamps",
        b'a 1 1700000000000\nb{x="y"} 2 -5\nc{x="y"}\t3\t+42\n',
        {"a": [({}, 1.0)], "b": [({"x": "y"}, 2.0)], "c": [({"x": "y"}, 3.0)]},
        0,
    ),
    (
        "trailing-whitespace",
        b'a 1   \nb{x="y"} 2\t\nc{x="y"} 3 17 \n',
        {"a": [({}, 1.0)], "b": [({"x": "y"}, 2.0)], "c": [({"x": "y"}, 3.0)]},
        0,
    ),
    ("leading-blanks", b'  a 1\n\tb{x="y"} 2\n', {"a": [({}, 1.0)], "b": [({"x": "y"}, 2.0)]}, 0),
    (
        "several-blanks-before-value",
        b'a  1\nb{x="y"}  \t2\n',
        {"a": [({}, 1.0)], "b": [({"x": "y"}, 2.0)]},
        0,
    ),
    (
        "colon-in-name",
        b'vllm:num_requests_running{engine="0"} 12.0\n',
        {"vllm:num_requests_running": [({"engine": "0"}, 12.0)]},
        0,
    ),
    (
        "histogram-run",
        b'# TYPE h histogram\nh_bucket{m="a",le="0.1"} 1\nh_bucket{m="a",le="1"} 3\n'
        b'h_bucket{m="a",le="+Inf"} 4\n'
        b'h_sum{m="a"} 2.5\nh_count{m="a"} 4\nh_bucket{m="b",le="0.1"} 0\nh_bucket{m="b",le="+Inf"} 1\n',
        {
            "h_bucket": [
                ({"m": "a", "le": "0.1"}, 1.0),
                ({"m": "a", "le": "1"}, 3.0),
                ({"m": "a", "le": "+Inf"}, 4.0),
                ({"m": "b", "le": "0.1"}, 0.0),
                ({"m": "b", "le": "+Inf"}, 1.0),
            ],
            "h_sum": [({"m": "a"}, 2.5)],
            "h_count": [({"m": "a"}, 4.0)],
        },
        0,
    ),
    (
        "run-broken-by-odd-lines",
        b'r{a="1",b="x"} 1\nr{a="1",b="x\\"y"} 2\nr{a="1",b="z",c="w"} 3\nr{a="1",b="} 4\n'
        b'r{a="1",b="q"} 5 6\n'
        b'r{a="1",b="q"} 7\n',
        {
            "r": [
                ({"a": "1", "b": "x"}, 1.0),
                ({"a": "1", "b": 'x"y'}, 2.0),
                ({"a": "1", "b": "z", "c": "w"}, 3.0),
                ({"a": "1", "b": "q"}, 5.0),
                ({"a": "1", "b": "q"}, 7.0),
            ]
        },
        1,
    ),
    (
        "run-with-escapes-blanks-and-bad-tokens",
        'h_bucket{m="a",le="0.1"} 1\nh_bucket{m="a",le=" 1 "} 2\nh_bucket{m="a",le="x\\\\y"} 3\n'
        'h_bucket{m="a",le="a\\nb"} 4\nh_bucket{m="a",le="2"} 1_0\nh_bucket{m="a",le="3"} \u0661\n'
        'h_bucket{m="a",le="4"} \t5\nh_bucket{m="a",le="5"} 6 7 8\nh_bucket{m="a",le="\\t"} 9\n'.encode(),
        {
            "h_bucket": [
                ({"m": "a", "le": "0.1"}, 1.0),
                ({"m": "a", "le": " 1 "}, 2.0),
                ({"m": "a", "le": "x\\y"}, 3.0),
                ({"m": "a", "le": "a\nb"}, 4.0),
                ({"m": "a", "le": "4"}, 5.0),
            ]
        },
        4,
    ),
    ("repeated-series-kept-in-order", b"a 1\nb 2\na 3\n", {"a": [({}, 1.0), ({}, 3.0)], "b": [({}, 2.0)]}, 0),
    ("missing-value", b'a{x="y"}\nb\nc{x="y"}   \n', {}, 3),
    ("non-numeric-value", b'a{x="y"} one\nb two\nc{x="y"} 0x10\nd 1,5\n', {}, 4),
    ("underscore-digits", b'a 1_000\nb{x="y"} 1_0\n', {}, 2),
    ("non-ascii-digits", 'a \u0661\u0662\nb{x="y"} \uff11\n'.encode(), {}, 2),
    ("bad-timestamp", b'a 1 2.5\nb{x="y"} 1 ts\nc 1 2 3\n', {}, 3),
    ("unterminated-quote", b'a{x="y} 1\nb{x="y,z="w} 1\nc{x="y\\"} 1\n', {}, 3),
    ("unquoted-value", b"a{x=y} 1\n", {}, 1),
    ("missing-comma", b'a{x="1"y="2"} 1\n', {}, 1),
    ("missing-close-brace", b'a{x="1" 1\n', {}, 1),
    ("double-comma", b'a{x="1",,y="2"} 1\nb{x="1",,} 1\n', {}, 2),
    ("lone-comma", b"a{,} 1\n", {}, 1),
    ("bad-label-name", b'a{1x="1"} 1\nb{x-y="1"} 1\nc{="1"} 1\n', {}, 3),
    ("duplicate-label", b'a{x="1",x="2"} 1\n', {}, 1),
    ("bad-escape", b'a{x="\\t"} 1\nb{x="\\u0041"} 1\nc{x="end\\\\\\"} 1\n', {}, 3),
    ("bad-metric-name", b'1a 1\n{x="y"} 1\na-b 1\n"a" 1\n', {}, 4),
    ("garbage", b'<html><body>502 Bad Gateway</body></html>\n{"error": "x"}\n\x00\x01\n', {}, 3),
    ("invalid-utf8-sample", b'a{x="\xff"} 1\nb 2\n', {"b": [({}, 2.0)]}, 1),
    ("invalid-utf8-comment", b"# HELP a caf\xe9\na 1\n", {"a": [({}, 1.0)]}, 0),
    (
        "good-around-bad",
        b'a{x="1"} 1\na{x="1" 2\na{x="1"} 3\n',
        {"a": [({"x": "1"}, 1.0), ({"x": "1"}, 3.0)]},
        1,
    ),
]
CASE_IDS = [case[0] for case in CASES]


@pytest.mark.parametrize(("body", "samples", "malformed"), [case[1:] for case in CASES], ids=CASE_IDS)
def test_whole_body(body: bytes, samples: dict, malformed: int) -> None:
    assert comparable(parse_exposition(body)) == (samples, malformed)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return
    assert comparable(parse_exposition(text)) == (samples, malformed)
    assert comparable(parse_exposition(body.replace(b"\n", b"\r\n"))) == (samples, malformed)
    # Lines are independent of each other: the runs and per-body caches change nothing.
    assert merged(*(parse_exposition(line) for line in body.split(b"\n"))) == (samples, malformed)


@pytest.mark.parametrize("body", [case[1] for case in CASES], ids=CASE_IDS)
def test_cut_at_every_byte(body: bytes) -> None:
    """A body cut anywhere: complete lines parse as in the whole body, the tail is one line."""
    lines = body.split(b"\n")
    per_line = [parse_exposition(line) for line in lines]
    for cut in range(len(body) + 1):
        prefix = body[:cut]
        complete_lines = prefix.count(b"\n")
        partial = prefix[prefix.rfind(b"\n") + 1 :]
        got = parse_exposition(prefix)
        tail = parse_exposition(partial)
        assert merged(got) == merged(*per_line[:complete_lines], tail)
        # The truncated line is a sample, ignored, or one malformed line; never more.
        assert sum(map(len, tail.samples.values())) + tail.malformed_lines <= 1


JUNK = [
    b"junk",
    b"<html><head><title>503 Service Unavailable</title></head></html>",
    b'{"error": "upstream connect error"}',
    b"\xff\xfe\x00\x80 garbage",
    b'llm_d_epp_ready_endpoints{name="llama3-8b-pool"',
    b'llm_d_epp_ready_endpoints{name="llama3-8b-pool} 4',
    b'llm_d_epp_ready_endpoints{name="llama3-8b-pool"} four',
    b'llm_d_epp_ready_endpoints{name="llama3-8b-pool"} 4 5 6',
    b"\x00",
    b'"',
]


@pytest.mark.parametrize("junk", JUNK)
@pytest.mark.parametrize(("body", "samples", "malformed"), [case[1:] for case in CASES], ids=CASE_IDS)
def test_trailing_junk(body: bytes, samples: dict, malformed: int, junk: bytes) -> None:
    if body and not body.endswith(b"\n"):
        body += b"\n"
    assert comparable(parse_exposition(body + junk)) == (samples, malformed + 1)
    assert comparable(parse_exposition(body + junk + b"\n")) == (samples, malformed + 1)


def test_blank_and_comment_only_junk_is_not_malformed() -> None:
    assert comparable(parse_exposition(b"a 1\n\n# trailing comment\n   \r\n")) == ({"a": [({}, 1.0)]}, 0)


def test_labels_dicts_are_independent() -> None:
    """Histogram lines share a prefix; each sample still owns its labels dict."""
    result = parse_exposition(
        b'h_bucket{m="a",le="1"} 1\nh_bucket{m="a",le="2"} 2\nh_bucket{m="a",le="3"} 3\n'
    )
    first, second, third = (labels for labels, _ in result.samples["h_bucket"])
    first["m"] = "changed"
    assert second == {"m": "a", "le": "2"} and third == {"m": "a", "le": "3"}


def test_label_layout_cache_is_bounded() -> None:
    """Past the cache bound, new label layouts still parse (and still fail) correctly."""
    saved = dict(exposition._BUILDERS)
    try:
        count = exposition._BUILDERS_MAX + 20
        body = "\n".join(f'm{{a{i}="v",b="{i}"}} {i}' for i in range(count))
        # An unterminated last value, a layout with blanks, and a good line.
        body += '\nm{late1="v",late2="} 1\nm{ late1="v"} 3\nm{late1="v",late2="w"} 2\n'
        result = parse_exposition(body)
        assert len(exposition._BUILDERS) <= exposition._BUILDERS_MAX
        assert result.malformed_lines == 1
        assert result.samples["m"][-2:] == [({"late1": "v"}, 3.0), ({"late1": "v", "late2": "w"}, 2.0)]
        assert result.samples["m"][count - 1] == (
            {f"a{count - 1}": "v", "b": str(count - 1)},
            float(count - 1),
        )
        assert len(result.samples["m"]) == count + 2
    finally:
        exposition._BUILDERS.clear()
        exposition._BUILDERS.update(saved)


def test_large_and_hostile_lines() -> None:
    """Big label sets, long blank runs and escape runs parse right (and in linear time)."""
    many = ",".join(f'l{i}="v{i}"' for i in range(5000))
    body = "\n".join(
        [
            f"big{{{many}}} 1",
            f"big{{{many}}} 2",
            f'big{{{many},l0="again"}} 3',
            f'big{{{many},z="}} 4',
            "blanks" + " " * 100_000 + "1",
            "blanks" + " " * 100_000 + "x y z",
            'esc{v="' + "\\\\" * 50_000 + '"} 5',
            "quotes{" + '"' * 100_000 + "} 6",
        ]
    )
    result = parse_exposition(body)
    labels = {f"l{i}": f"v{i}" for i in range(5000)}
    assert result.samples == {
        "big": [(labels, 1.0), (labels, 2.0)],
        "blanks": [({}, 1.0)],
        "esc": [({"v": "\\" * 50_000}, 5.0)],
    }
    assert result.malformed_lines == 4


# Reference samples (tests/data/samples): exact counts and values for named series.
def series(result: Exposition, sample_name: str, /, **labels: str) -> list[float]:
    """Values of `sample_name` samples whose labels include `labels`, in input order."""
    return [
        value
        for got, value in result.samples.get(sample_name, [])
        if all(got.get(k) == v for k, v in labels.items())
    ]


def sample_count(result: Exposition) -> int:
    return sum(map(len, result.samples.values()))


Multiset = Counter[tuple[str, tuple[tuple[str, str], ...], object]]


def prometheus_client_samples(text: str) -> Multiset:
    return Counter(
        (s.name, tuple(sorted(s.labels.items())), NAN if math.isnan(s.value) else float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    )


def gridd_samples(result: Exposition) -> Multiset:
    return Counter(
        (name, tuple(sorted(labels.items())), NAN if math.isnan(value) else value)
        for name, values in result.samples.items()
        for labels, value in values
    )


SAMPLE_FILES = [
    "epp-healthy.prom",
    "epp-saturated.prom",
    "epp-zero-ready.prom",
    "epp-multi-pool.prom",
    "vllm-direct.prom",
]


@pytest.mark.parametrize("filename", SAMPLE_FILES)
def test_reference_sample_parses_like_prometheus_client(samples_dir: pathlib.Path, filename: str) -> None:
    raw = (samples_dir / filename).read_bytes()
    result = parse_exposition(raw)
    assert result.malformed_lines == 0
    sample_lines = [line for line in raw.decode().split("\n") if line.strip() and not line.startswith("#")]
    assert sample_count(result) == len(sample_lines)
    assert gridd_samples(result) == prometheus_client_samples(raw.decode())


def test_epp_healthy(samples_dir: pathlib.Path) -> None:
    result = parse_exposition((samples_dir / "epp-healthy.prom").read_bytes())
    assert series(result, "llm_d_epp_ready_endpoints", name="llama3-8b-pool") == [4.0]
    assert series(result, "inference_pool_ready_pods", name="llama3-8b-pool") == [4.0]
    assert series(result, "llm_d_epp_average_kv_cache_utilization", name="llama3-8b-pool") == [0.43]
    assert series(result, "llm_d_epp_flow_control_pool_saturation", stage="effective") == [0.5375]
    assert len(series(result, "llm_d_epp_per_endpoint_queue_size", name="llama3-8b-pool")) == 4
    assert len(result.samples["llm_d_epp_inflight_requests"]) == 16
    assert len(result.samples["llm_d_epp_request_ttft_seconds_bucket"]) == 75
    assert sum(series(result, "llm_d_epp_request_ttft_seconds_count")) == 1829
    assert series(result, "llm_d_epp_request_ttft_seconds_bucket", fairness_id="team-a", le="+Inf") == [339.0]


def test_epp_saturated(samples_dir: pathlib.Path) -> None:
    result = parse_exposition((samples_dir / "epp-saturated.prom").read_bytes())
    assert series(result, "llm_d_epp_ready_endpoints", name="llama3-8b-pool") == [4.0]
    assert series(result, "llm_d_epp_average_kv_cache_utilization", name="llama3-8b-pool") == [0.96]
    assert series(result, "llm_d_epp_flow_control_pool_saturation", stage="effective") == [2.95]
    assert len(result.samples["llm_d_epp_request_ttft_seconds_bucket"]) == 100
    assert len(result.samples["llm_d_epp_inflight_requests"]) == 12


def test_epp_zero_ready(samples_dir: pathlib.Path) -> None:
    result = parse_exposition((samples_dir / "epp-zero-ready.prom").read_bytes())
    assert series(result, "llm_d_epp_ready_endpoints", name="llama3-8b-pool") == [0.0]
    assert series(result, "inference_pool_ready_pods", name="llama3-8b-pool") == [0.0]
    # Stale averages stay exposed; the parser reports them as they are.
    assert series(result, "llm_d_epp_average_kv_cache_utilization", name="llama3-8b-pool") == [0.61]
    assert series(result, "llm_d_epp_flow_control_pool_saturation", stage="effective") == [1.0]
    assert "llm_d_epp_per_endpoint_queue_size" not in result.samples
    assert len(result.samples["llm_d_epp_inflight_requests"]) == 2


def test_epp_multi_pool(samples_dir: pathlib.Path) -> None:
    result = parse_exposition((samples_dir / "epp-multi-pool.prom").read_bytes())
    assert series(result, "llm_d_epp_ready_endpoints", name="llama3-8b-pool") == [4.0]
    assert series(result, "llm_d_epp_ready_endpoints", name="qwen3-32b-pool") == [2.0]
    assert series(result, "llm_d_epp_average_kv_cache_utilization", name="qwen3-32b-pool") == [0.86]
    assert len(result.samples["llm_d_epp_per_endpoint_queue_size"]) == 6


def test_vllm_direct(samples_dir: pathlib.Path) -> None:
    result = parse_exposition((samples_dir / "vllm-direct.prom").read_bytes())
    model = "meta-llama/Llama-3.1-8B-Instruct"
    assert series(result, "vllm:num_requests_running", engine="0", model_name=model) == [12.0]
    assert series(result, "vllm:num_requests_waiting", engine="0", model_name=model) == [1.0]
    assert series(result, "vllm:kv_cache_usage_perc", engine="0") == [0.4117647058823529]
    assert len(result.samples["vllm:time_to_first_token_seconds_bucket"]) == 23
    assert "llm_d_epp_ready_endpoints" not in result.samples


# The wanted filter.
GRIDD_WANTED = frozenset(
    {
        "llm_d_epp_ready_endpoints",
        "llm_d_epp_average_kv_cache_utilization",
        "llm_d_epp_per_endpoint_queue_size",
        "llm_d_epp_request_ttft_seconds_bucket",
        "llm_d_epp_request_ttft_seconds_count",
        "inference_pool_ready_pods",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
    }
)


@pytest.mark.parametrize("filename", SAMPLE_FILES)
def test_wanted_keeps_exactly_the_wanted_series(samples_dir: pathlib.Path, filename: str) -> None:
    raw = (samples_dir / filename).read_bytes()
    everything = parse_exposition(raw)
    kept = parse_exposition(raw, GRIDD_WANTED)
    assert kept.malformed_lines == 0
    assert kept.samples == {name: s for name, s in everything.samples.items() if name in GRIDD_WANTED}


@pytest.mark.parametrize("container", [list, tuple, frozenset, dict.fromkeys])
def test_wanted_accepts_any_container(container) -> None:
    body = b'a{x="1"} 1\nb{x="2"} 2\nc 3\n'
    assert parse_exposition(body, container(["b", "c", "zzz"])).samples == {
        "b": [({"x": "2"}, 2.0)],
        "c": [({}, 3.0)],
    }


def test_wanted_empty_keeps_nothing() -> None:
    result = parse_exposition(b'a{x="1"} 1\nb 2\n', set())
    assert (result.samples, result.malformed_lines) == ({}, 0)


def test_wanted_exact_names_not_prefixes() -> None:
    body = b"ab 1\na 2\nabc 3\na_bucket 4\n"
    assert parse_exposition(body, {"a"}).samples == {"a": [({}, 2.0)]}


def test_wanted_skips_unwanted_lines_unchecked() -> None:
    """A line whose name is valid and unwanted is not looked at, so never counted."""
    body = (
        b'unwanted{x="1" broken\n'
        b"unwanted not-a-number\n"
        b'  unwanted{x="\\q"} 1\n'
        b'kept{x="1"} 1\n'
        b'kept{x="1" 2\n'
        b"kept nope\n"
        b"<html>\n"
        b'{"error": 1}\n'
        b"\xff\xfe\n"
        b"unwanted\xff 1\n"
    )
    result = parse_exposition(body, {"kept"})
    assert result.samples == {"kept": [({"x": "1"}, 1.0)]}
    # kept's two bad lines, <html>, the JSON body and the undecodable line with no name.
    assert result.malformed_lines == 5
    assert parse_exposition(body).malformed_lines == 9


def test_wanted_name_with_only_malformed_lines_is_absent() -> None:
    result = parse_exposition(b'a{x="1" 1\na nope\n', {"a"})
    assert (result.samples, result.malformed_lines) == ({}, 2)


# prometheus_client as an oracle on generated valid expositions.
metric_names = st.from_regex(r"[a-zA-Z_:][a-zA-Z0-9_:]{0,20}", fullmatch=True)
label_names = st.from_regex(r"[a-zA-Z][a-zA-Z0-9_]{0,12}", fullmatch=True)  # no reserved "__" prefix
label_values = st.text(
    st.one_of(
        st.sampled_from(list('"\\\n{},= =\t\r#}\u2028\x85\xe9')),
        st.characters(exclude_categories=["Cs"]),
    ),
    max_size=16,
)


def escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@st.composite
def value_texts(draw) -> str:
    kind = draw(st.sampled_from(["int", "float", "exp", "special"]))
    if kind == "int":
        return str(draw(st.integers(-(10**20), 10**20)))
    if kind == "special":
        return draw(st.sampled_from(["NaN", "+Inf", "-Inf", "Inf", "nan", "inf", "-inf"]))
    number = draw(st.floats(allow_nan=False, allow_infinity=False))
    return repr(number) if kind == "float" else f"{number:e}"


@st.composite
def sample_lines(draw) -> str:
    name = draw(metric_names)
    names = draw(st.lists(label_names, max_size=5, unique=True))
    pairs = [f'{label}="{escape(draw(label_values))}"' for label in names]
    block = ""
    if pairs or draw(st.booleans()):
        block = "{" + ",".join(pairs) + ("," if pairs and draw(st.booleans()) else "") + "}"
    value = draw(value_texts())
    timestamp = f" {draw(st.integers(-(10**13), 10**13))}" if draw(st.booleans()) else ""
    separator = draw(st.sampled_from([" ", "  "]))
    return f"{name}{block}{separator}{value}{timestamp}{draw(st.sampled_from(['', ' ', '  ']))}"


@st.composite
def expositions(draw) -> str:
    lines = []
    for line in draw(st.lists(sample_lines(), max_size=12)):
        extra = draw(st.sampled_from(["", "", "", "blank", "comment", "help"]))
        if extra == "blank":
            lines.append("")
        elif extra == "comment":
            lines.append('# a comment, {with} "quotes"')
        elif extra == "help":
            name = line.split("{")[0].split(" ")[0]
            lines.append(f"# HELP {name} Some help text.")
        lines.append(line)
    ending = draw(st.sampled_from(["\n", "\r\n"]))
    return ending.join(lines) + (ending if draw(st.booleans()) else "")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(expositions())
def test_matches_prometheus_client_on_valid_expositions(text: str) -> None:
    result = parse_exposition(text.encode())
    assert result.malformed_lines == 0
    assert gridd_samples(result) == prometheus_client_samples(text)


# The fast paths against the full grammar, on lines near the canonical form.
NEAR_MISS_EDITS = [
    "\\",
    "\\",
    '"',
    '"',
    "\\n",
    "\\\\",
    '\\"',
    "\\t",
    "_",
    "_",
    " ",
    " ",
    "\t",
    "\r",
    "\x0b",
    "\x0c",
    "\x1c",
    "\xa0",
    "\u2028",
    "\u0661",
    "{",
    "}",
    "} ",
    ",",
    "=",
    "#",
    "e",
    "E",
    ".",
    "+",
    "-",
    "0",
    "9",
    "x",
    "NaN",
    "Inf",
]


@st.composite
def near_miss_bodies(draw) -> str:
    """Canonical lines sharing prefixes (so runs form), some of them edited near the end."""
    base = draw(
        st.sampled_from(
            [
                'h_bucket{m="a",le="0.1"} 12',
                'r{endpoint="e-1",flow="f",producer="p"} 30',
                'g{name="pool"} 0.25',
                "bare 70",
                "e{} 15",
            ]
        )
    )
    lines = []
    for _ in range(draw(st.integers(1, 8))):
        line = base.replace("0.1", draw(st.sampled_from(["0.1", "1", "+Inf", "x y"])))
        for _ in range(draw(st.integers(0, 3))):
            # Mostly edit the last label value and the value, where the runs look.
            low = draw(st.sampled_from([0, max(0, len(line) - 10)]))
            at = draw(st.integers(low, len(line)))
            edit = draw(st.sampled_from(NEAR_MISS_EDITS))
            action = draw(st.sampled_from(["insert", "delete", "replace"]))
            if action == "insert":
                line = line[:at] + edit + line[at:]
            elif action == "delete":
                line = line[:at] + line[at + 1 :]
            else:
                line = line[:at] + edit + line[at + 1 :]
        lines.append(line)
    return "\n".join(lines)


@settings(max_examples=300, deadline=None)
@given(near_miss_bodies())
def test_fast_paths_agree_with_full_grammar(body: str) -> None:
    expected: dict[str, list[tuple[dict[str, str], object]]] = {}
    malformed = 0
    for line in body.split("\n"):
        parsed = _parse_line(line)
        if parsed is None:
            malformed += 1
        elif parsed:
            name, labels, value = parsed
            expected.setdefault(name, []).append((labels, NAN if math.isnan(value) else value))
    assert comparable(parse_exposition(body)) == (expected, malformed)
    assert comparable(parse_exposition(body.encode())) == (expected, malformed)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_never_raise(body: bytes) -> None:
    result = parse_exposition(body)
    assert result.malformed_lines <= body.count(b"\n") + 1
    assert sum(map(len, result.samples.values())) + result.malformed_lines <= body.count(b"\n") + 1


# The scan: with a set of wanted names, only the lines that can change the result are visited
# (exposition._scan). A list of the same names takes the line loop over every line; both
# must agree exactly, malformed counts included.
SCAN_NAMES = ["kept", "kept_total", "k:v", "kept_bucket", "other", "kep"]
SCAN_EDITS = ["", " ", "\t", "x", "_x", ":", "-", "{", "}", '"', "\\", "#", "0", "\r", "\xff", "\u2028", "é"]


@st.composite
def scan_bodies(draw) -> str:
    """Lines of wanted and unwanted names, names that extend or prefix a wanted one, leading
    blanks, comments, garbage and near-misses, in any order."""
    lines = []
    for _ in range(draw(st.integers(0, 14))):
        name = draw(st.sampled_from(SCAN_NAMES))
        line = draw(
            st.sampled_from(
                [
                    f'{name}{{a="1",le="0.5"}} 3',
                    f'{name}{{a="1",le="+Inf"}} 4',
                    f"{name} 7",
                    f"{name}{{}} 1",
                    f"# TYPE {name} counter",
                    "",
                    "<html>",
                    '{"error": 1}',
                    "12 3",
                    f'{name}{{a="1" 2',
                    f"{name} nope",
                ]
            )
        )
        at = draw(st.integers(0, len(line)))
        edit = draw(st.sampled_from(SCAN_EDITS))
        lines.append(line[:at] + edit + line[at:] if draw(st.booleans()) else line)
    return draw(st.sampled_from(["\n", "\r\n"])).join(lines) + draw(st.sampled_from(["", "\n"]))


@settings(max_examples=400, deadline=None)
@given(scan_bodies(), st.sets(st.sampled_from(SCAN_NAMES)))
def test_the_scan_agrees_with_the_line_loop(body: str, wanted: set[str]) -> None:
    loop = parse_exposition(body, sorted(wanted))
    for scanned in (
        parse_exposition(body, wanted),
        parse_exposition(body, frozenset(wanted)),
        parse_exposition(body.encode(), wanted),
    ):
        assert comparable(scanned) == comparable(loop)


@pytest.mark.parametrize("filename", SAMPLE_FILES)
def test_the_scan_agrees_with_the_line_loop_on_the_samples(samples_dir: pathlib.Path, filename: str) -> None:
    raw = (samples_dir / filename).read_bytes()
    assert comparable(parse_exposition(raw, GRIDD_WANTED)) == comparable(
        parse_exposition(raw, sorted(GRIDD_WANTED))
    )


def test_the_scan_still_visits_lines_with_leading_blanks_and_counts_lines_without_a_name() -> None:
    body = b'  kept 1\n\tkept{a="1"} 2\nkept_x{ 3\n<html>\n7 7\nkeptx 4\nkept\xff 5\n#kept 6\n'
    result = parse_exposition(body, {"kept"})
    assert result.samples == {"kept": [({}, 1.0), ({"a": "1"}, 2.0)]}
    # <html>, "7 7" and the undecodable line whose leading name is "kept" (the body does not
    # decode, so this one takes the line-by-line path).
    assert result.malformed_lines == 3
    assert parse_exposition(body.replace(b"\xff", b"-"), {"kept"}).malformed_lines == 3


def test_scan_alternation_matches_exactly_the_names() -> None:
    import re

    names = sorted({"a", "ab", "abc", "b", "bcd", "bce", "a:b", "a_", "x.y"})
    alternation = re.compile(f"(?:{exposition_scan._name_alternation(names)})")
    for name in names:
        assert alternation.fullmatch(name)
        for near in (name + "q", name[:-1], name[1:]):
            assert bool(alternation.fullmatch(near)) == (near in names), near


# max_lines: a body holding more newlines is refused before any line is read one by one,
# on every path (the scan, the line loop, the undecodable body); a body read through the
# target's shape is not counted (gridd.core.publication.MAX_EXPOSITION_LINES has why).
KEPT = frozenset({"kept"})
LIMITED = ["kept 1", "# TYPE kept gauge", "<html>", "other 2", 'kept{a="1"} 3']


@pytest.mark.parametrize("wanted", [None, ["kept"], {"kept"}])
@pytest.mark.parametrize("encoding", ["str", "bytes", "undecodable"])
def test_max_lines_refuses_a_body_with_more_newlines(wanted, encoding: str) -> None:
    text = "\n".join(LIMITED)
    body: str | bytes = text if encoding == "str" else text.encode()
    if encoding == "undecodable":
        body = text.encode().replace(b"<html>", b"<\xff>")
    newlines = len(LIMITED) - 1
    unlimited = parse_exposition(body, wanted)
    assert comparable(parse_exposition(body, wanted, max_lines=newlines)) == comparable(unlimited)
    with pytest.raises(exposition.TooManyLines, match=f"^more than {newlines - 1} lines$"):
        parse_exposition(body, wanted, max_lines=newlines - 1)


def test_max_lines_does_not_count_a_body_read_through_its_shape() -> None:
    cache = exposition.SeriesCache()  # kept under one wanted object (KEPT)
    steady = "\n".join(['kept{a="1"} 1', "# TYPE other gauge", "other 2", 'kept{a="2"} 3'])
    for _ in range(2):
        parse_exposition(steady, KEPT, cache)
    shape, series = cache.shape, dict(cache.series)
    assert shape is not None
    # Padded with lines the scan leaves out: the picked lines are the shape's, no count.
    padded = steady.replace(" 3", " 4") + "\n" * 10 + "other 5\n" * 10
    read = parse_exposition(padded, KEPT, cache, max_lines=3)
    assert read.layout is shape
    assert comparable(read) == comparable(parse_exposition(padded, KEPT))
    # Padded with lines it picks: not the shape's lines, so counted and refused, the cache
    # as it was (the next scrape of the steady body still reads through the shape).
    for picked in (" \n" * 10, "kept 9\n" * 10):
        with pytest.raises(exposition.TooManyLines):
            parse_exposition(steady + "\n" + picked, KEPT, cache, max_lines=3)
        assert cache.shape is shape and cache.series == series
    assert parse_exposition(steady, KEPT, cache, max_lines=3).layout is shape
