"""Fuzzing with hypothesis (issue 15): the exposition parser, the signals-channel wire
decoder and admission, the config loader, the providers API's payloads and the HTTP
front's request parsing (the ASGI app and the raw h11 server). Each target's rule: bad
input gets its documented error or a counted drop, never another exception, never a 5xx
the design does not name.

A short run in CI (GRIDD_FUZZ_EXAMPLES, default 150 per target); the long run is
`GRIDD_FUZZ_EXAMPLES=100000 .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_fuzz.py`
(docs/reliability.md has its counts). Every crash found becomes a regression test here, named
for what it was."""

from __future__ import annotations

import copy
import json
import math
import os
import pathlib
import random
import tempfile

import httpx
import msgspec
import trio
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from support import FRONT_MODEL, WRITE_TOKEN, FakeRouter, ProvidersRig, always, local

from gridd import wire
from gridd.config import parse_config
from gridd.core.admission import AdmissionFences, Outcome
from gridd.core.exposition import parse_exposition
from gridd.errors import ConfigError
from gridd.gateway.front import make_front_app
from gridd.http.serve import serve_asgi

REPO = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = int(os.environ.get("GRIDD_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 1000,
                suppress_health_check=list(HealthCheck))

# -- the exposition parser ------------------------------------------------------------------------

_names = st.sampled_from(["vllm:num_requests_waiting", "vllm:num_requests_running",
                          "inference_pool_ready_pods", "inference_pool_per_pod_queue_size", "x", "_",
                          "a:b_c", "9bad", "vllm:kv_cache_usage_perc"])
_label_value = st.lists(st.sampled_from(list('ab"\\\n{},= \t\x00é') + ["\\n", '\\"', "\\\\"]),
                        max_size=8).map("".join)
_label = st.tuples(st.sampled_from(["name", "pod", "model_name", "le", "", "9", "a b"]), _label_value)
_value = st.one_of(st.sampled_from(["0", "1", "-1", "NaN", "+Inf", "-Inf", "1e308", "1e309", "0x10", "1_0",
                                    "", "--1", "3.5", "nan", "inf"]), st.floats(allow_nan=True).map(repr))


@st.composite
def _exposition_line(draw) -> str:
    kind = draw(st.integers(0, 5))
    if kind == 0:
        return draw(st.sampled_from(["# TYPE x gauge", "# HELP x y", "#", "# EOF", "", "   ", "\t# TYPE"]))
    if kind == 1:
        return draw(st.text(max_size=40))
    labels = draw(st.lists(_label, max_size=4))
    body = ",".join(f'{k}="{v}"' for k, v in labels)
    brace = (draw(st.sampled_from(["{%s}", "{%s", "%s}", "{%s,}", "{ %s }"])) % body
             if labels or kind == 2 else "")
    stamp = draw(st.sampled_from(["", " 1700000000000", " x", " 1 2"]))
    return f"{draw(_names)}{brace} {draw(_value)}{stamp}"


@FUZZ
@given(st.one_of(st.binary(max_size=2048),
                 st.lists(_exposition_line(), max_size=30).map("\n".join),
                 st.lists(_exposition_line(), max_size=30).map(lambda ls: "\r\n".join(ls).encode())),
       st.sampled_from([None, {"vllm:num_requests_waiting"}, {"x", "inference_pool_ready_pods"}]))
def test_fuzz_exposition_parser_never_raises(body, wanted):
    out = parse_exposition(body, wanted)
    assert out.malformed_lines >= 0
    for name, samples in out.samples.items():
        assert isinstance(name, str)
        for labels, value in samples:
            assert isinstance(value, float) and isinstance(labels, dict)


# -- the wire decoder and admission -----------------------------------------------------------------

_scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(),
                    st.text(max_size=20), st.binary(max_size=8))
_tree = st.recursive(_scalar, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=5)), max_leaves=25)
_kinds = st.sampled_from(["poll", "batches", "serving", "report", "ack", "error", "nope", ""])
_batch_keys = ["site", "provider", "model", "publisher_epoch", "batch_sequence", "published_ms", "ready",
               "load", "revision", "complete", "age_ms", "provider_uid", "generation"]
_message_keys = ["protocol", "batches", "cursor", "since", "sequence", "epoch", "ok", "message", "evidence",
                 "replica", "providers", "sites"]


@st.composite
def _frame(draw) -> bytes:
    """msgpack of a message-like map: a known tag with fields that are sometimes right."""
    msg = {"kind": draw(_kinds)}
    for key in draw(st.lists(st.sampled_from(_message_keys), max_size=5)):
        msg[key] = draw(_tree)
    if msg["kind"] == "batches" and draw(st.booleans()):
        msg["batches"] = [{k: draw(st.one_of(_scalar, _tree))
                           for k in draw(st.lists(st.sampled_from(_batch_keys), max_size=10))}
                          for _ in range(draw(st.integers(0, 3)))]
    return msgspec.msgpack.encode(msg)


@FUZZ
@given(st.one_of(st.binary(max_size=1024), _frame()), st.floats(0, 4e9))
def test_fuzz_wire_decode_and_admission(frame, now_wall):
    try:
        msg = wire.decode(frame)
    except wire.WireDecodeError:
        return
    if isinstance(msg, wire.Batches):
        fences = AdmissionFences()
        for batch in msg.batches:
            admission = fences.admit(batch, now_wall=now_wall, verified_site=None)
            assert isinstance(admission.outcome, Outcome)
            wire.ordering(batch)
            wire.with_added_age(batch, 1.5)


# -- the config loader ------------------------------------------------------------------------------

_EXAMPLES = [yaml.safe_load((REPO / "examples" / name).read_text())
             for name in ("operator.yaml", "gateway.yaml")]


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*prefix, i))


@st.composite
def _mutated_config(draw) -> str:
    tree = copy.deepcopy(draw(st.sampled_from(_EXAMPLES)))
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(tree) if p]
        path = draw(st.sampled_from(paths))
        parent = tree
        for part in path[:-1]:
            parent = parent[part]
        choice = draw(st.integers(0, 3))
        if choice == 0:
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(st.one_of(_scalar.filter(lambda v: not isinstance(v, bytes)),
                                              st.sampled_from(["${NOPE}", "${HOME}", "0.0.0.0:0", "http://x",
                                                               "-1", "1e400", "", "unix:/tmp/x"])))
    return yaml.safe_dump(tree)


@FUZZ
@given(st.one_of(_mutated_config(), st.text(max_size=300),
                 st.sampled_from(["role: [", "{", "role: operator\nsite: a\n" * 2, "\x00", "- 1\n- 2",
                                  "role: operator\nsite: !!python/object:os.system x"])))
def test_fuzz_config_loader_raises_config_error_only(text):
    try:
        parse_config(text, env={"HOME": "/root"}, source="fuzz.yaml")
    except ConfigError as exc:
        assert str(exc)


# -- the providers API ------------------------------------------------------------------------------

_provider_body = st.fixed_dictionaries({}, optional={
    "model": st.one_of(st.text(max_size=30), _tree),
    "type": st.one_of(st.sampled_from(["hosted_vllm", "openai", "x"]), _tree),
    "enabled": st.one_of(st.booleans(), _tree),
    "settings": st.one_of(st.fixed_dictionaries({}, optional={
        "endpoint": st.one_of(st.sampled_from(["http://127.0.0.1:9/v1", "ftp://x", "http://u:p@h/v1", "",
                                               "********"]), st.text(max_size=20)),
        "timeout": st.one_of(st.floats(), st.integers(), st.text(max_size=4)),
        "auth": st.one_of(_tree, st.fixed_dictionaries(
            {"scheme": st.sampled_from(["none", "bearer", "header", "x"])},
            optional={"api_key": st.one_of(st.none(), st.text(max_size=10)), "custom_headers": _tree}))}),
        _tree),
    "metrics": _tree, "metadata": _tree, "probes": _tree, "unknown": _tree})


@FUZZ
@given(st.sampled_from(["GET", "PUT", "POST", "PATCH", "DELETE", "HEAD", "OPTIONS"]),
       st.sampled_from(["/providers", "/providers/new", "/providers/local", "/providers/", "/providers/a/b",
                        "/providers/%00", "/providers/" + "x" * 300, "/", "/providers?x=1"]),
       st.one_of(_provider_body.map(lambda b: json.dumps(b, default=repr).encode()), st.binary(max_size=200),
                 _tree.map(lambda t: json.dumps(t, default=repr).encode())),
       st.sampled_from(["application/json", "text/plain", "", "application/json; charset=utf-8"]))
async def test_fuzz_providers_api_payloads(method, path, body, content_type):
    with tempfile.TemporaryDirectory() as tmp:
        rig = ProvidersRig(pathlib.Path(tmp))
        headers = {"authorization": f"Bearer {WRITE_TOKEN}"}
        if content_type:
            headers["content-type"] = content_type
        r = await rig.client.request(method, path, content=body, headers=headers)
        assert r.status_code < 500, (r.status_code, r.text)
        if r.status_code >= 400 and method != "HEAD":
            assert "error" in r.json()
        # The config on disk still loads (a rejected write left it unchanged).
        parse_config(rig.path.read_text(), env={"LLAMA_KEY": "k", "SECRET_KEY": "s", "ADMIN_TOKEN": "t"})


# -- the HTTP front ---------------------------------------------------------------------------------

_FRONT_STATUSES = {200, 400, 404, 405, 413, 421, 502}


def _upstream(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={"ok": True})


_front_body = st.one_of(
    st.binary(max_size=300),
    st.fixed_dictionaries({}, optional={"model": st.one_of(st.just(FRONT_MODEL), st.text(max_size=10), _tree),
                                        "messages": _tree, "stream": _tree})
    .map(lambda d: json.dumps(d, default=repr).encode()),
    _tree.map(lambda t: json.dumps(t, default=repr).encode()))
_header_name = st.sampled_from(["content-type", "x-gridd-site", "transfer-encoding", "connection",
                                "authorization", "accept-encoding", "x-custom", "expect", "te", "host"])
_header_value = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=20)


@FUZZ
@given(st.sampled_from(["POST", "GET", "PUT", "HEAD", "DELETE", "OPTIONS"]),
       st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models", "/healthz",
                        "/readyz", "/v1/chat/completions?x=1", "/v2", "/v1/../admin", "//v1/models"]),
       st.lists(st.tuples(_header_name, _header_value), max_size=4), _front_body)
async def test_fuzz_front_request_parsing(method, path, headers, body):
    router = FakeRouter("a", always(local("a", "p", "http://upstream.invalid")))
    app = make_front_app(router, httpx.MockTransport(_upstream), CollectorRegistry(), rng=random.Random(1),
                         created_unix=1_700_000_000)
    clean = [(k, v) for k, v in headers if k not in ("transfer-encoding", "host", "content-length")]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
        r = await client.request(method, path, headers=clean, content=body)
    assert r.status_code in _FRONT_STATUSES | {503}, (r.status_code, r.text)
    if r.status_code >= 400 and method != "HEAD" and path.startswith("/v1"):
        error = r.json()["error"]
        assert {"message", "type", "code"} <= set(error)


_raw_line = st.one_of(
    st.sampled_from([b"POST /v1/chat/completions HTTP/1.1", b"GET / HTTP/1.0", b"GET /healthz HTTP/1.1",
                     b"BREW /pot HTCPCP/1.0", b"GET", b"", b"\x16\x03\x01\x00", b"POST /v1/models HTTP/2.0"]),
    st.binary(max_size=60).filter(lambda b: b"\n" not in b))
_raw_header = st.one_of(
    st.sampled_from([b"Host: gw", b"Content-Length: 5", b"Content-Length: -1",
                     b"Content-Length: 99999999999999", b"Transfer-Encoding: chunked",
                     b"Transfer-Encoding: gzip, chunked", b"Content-Length: 1, 2",
                     b"Expect: 100-continue", b"Connection: close", b" folded", b"X: " + b"y" * 5000, b"::"]),
    st.binary(max_size=40).filter(lambda b: b"\n" not in b))


@FUZZ
@given(_raw_line, st.lists(_raw_header, max_size=6), st.binary(max_size=100),
       st.sampled_from([b"\r\n", b"\n"]))
async def test_fuzz_raw_http_server_answers_or_closes_and_keeps_serving(line, headers, body, eol):
    """Raw bytes at the real h11 server in front of the front app: an answer (a status line)
    or a close within the bound, and the server still serves the next client."""
    router = FakeRouter("a", always(local("a", "p", "http://upstream.invalid")))
    transport = httpx.MockTransport(_upstream)
    app = make_front_app(router, transport, CollectorRegistry(), rng=random.Random(1),
                         created_unix=1_700_000_000)
    async with trio.open_nursery() as nursery:
        [url] = await nursery.start(serve_asgi, app, ["127.0.0.1:0"])
        host, port = url.removeprefix("http://").split(":")
        raw = line + eol + b"".join(h + eol for h in headers) + eol + body
        with trio.fail_after(10):
            stream = await trio.open_tcp_stream(host, int(port))
            async with stream:
                await stream.send_all(raw)
                with trio.move_on_after(2):  # a request still waiting for its body: the server waits too
                    first = await stream.receive_some(65536)
                    assert first == b"" or first.startswith(b"HTTP/1.1 "), first[:80]
        with trio.fail_after(10):
            async with httpx.AsyncClient() as client:
                assert (await client.get(f"{url}/healthz")).status_code == 200
        nursery.cancel_scope.cancel()


def test_fuzz_budget_is_what_the_environment_says():
    """The long run's flag reaches every target (a typo in the variable would make the long run
    silently short)."""
    assert FUZZ.max_examples == EXAMPLES and EXAMPLES >= 1
    assert not math.isnan(EXAMPLES)
