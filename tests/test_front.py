"""The gateway's OpenAI front: pure pieces (Retry-After, targets, headers) table-driven, then the
app over real loopback sockets, driven by the official openai SDK (sync client in a worker
thread) against real simulators and small upstream ASGI apps served with serve_asgi.

Real sockets, so no autojump clock here; every wait is bounded (SDK timeout, fail_after)."""

from __future__ import annotations

import functools
import json
import random
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass

import h11
import httpx
import openai
import pytest
import trio
import trustme
from prometheus_client import CollectorRegistry
from support import FRONT_MODEL as MODEL
from support import FakeRouter, always, local

from gridd.core.decisions import Forward, Shed, Unavailable, UnknownModel
from gridd.gateway.forwarding import SSE_DONE
from gridd.gateway.front import make_front_app
from gridd.gateway.front_errors import retry_after_seconds
from gridd.gateway.front_limits import FrontLimits
from gridd.gateway.pin import PIN_HEADER
from gridd.gateway.upstream_client import UpstreamClient, make_upstream_client
from gridd.gateway.upstream_request import request_headers, response_headers, upstream_target
from gridd.http.serve import serve_asgi
from gridd.sim.app import SimApp, start_sim
from gridd.sim.model import knobs_from
from gridd.wire import LocalProvider

SEED = 7
BOUND_S = 10.0


# -- helpers ---------------------------------------------------------------------------------


def remote(site: str, provider: str, ingress: str) -> Forward:
    return Forward(site, provider, MODEL, ingress_url=ingress)


@dataclass
class Front:
    url: str
    registry: CollectorRegistry
    router: FakeRouter

    def sample(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    def requests(self, outcome: str, *, model: str = MODEL, site: str) -> float:
        return self.sample("gridd_gateway_requests_total", model=model, site=site, outcome=outcome)

    def answered(self) -> float:
        return sum(sample.value for family in self.registry.collect() for sample in family.samples
                   if sample.name == "gridd_gateway_requests_total")

    async def counted(self, n: int) -> None:
        """Wait until n requests are counted: the front counts a request after its last byte
        went out, so a client can hold the whole answer a moment before the count moves."""
        await until(lambda: self.answered() == n, within_s=1.0)


async def start_front(nursery, router: FakeRouter, *, limits: FrontLimits | None = None,
                      ingress_verify: ssl.SSLContext | None = None,
                      upstream: UpstreamClient | None = None) -> Front:
    limits = limits if limits is not None else FrontLimits()
    registry = CollectorRegistry()
    transport = upstream if upstream is not None else make_upstream_client()
    ingress = make_upstream_client(verify=ingress_verify) if ingress_verify is not None else None
    app = make_front_app(router, transport, registry, rng=random.Random(SEED), limits=limits,
                         ingress_transport=ingress, created_unix=1_700_000_000)

    async def serve(task_status):
        try:
            await serve_asgi(app, ["127.0.0.1:0"], task_status=task_status)
        finally:
            with trio.CancelScope(shield=True):
                await transport.aclose()
                if ingress is not None:
                    await ingress.aclose()

    urls = await nursery.start(serve)
    return Front(urls[0], registry, router)


async def start_app(nursery, app) -> str:
    return (await nursery.start(serve_asgi, app, ["127.0.0.1:0"]))[0]


def sdk(front: Front, timeout: float = BOUND_S) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{front.url}/v1", api_key="client-key", max_retries=0, timeout=timeout)


def chat_text(front: Front, **kwargs) -> str:
    with sdk(front) as client:
        answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                **kwargs)
    return answer.choices[0].message.content


def chat_stream_text(front: Front, **kwargs) -> str:
    with sdk(front) as client:
        parts = []
        for chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                    stream=True, **kwargs):
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
    return "".join(parts)


def expect_error(front: Front, error: type[Exception], **kwargs) -> Exception:
    def call():
        with sdk(front) as client:
            try:
                client.chat.completions.create(model=kwargs.pop("model", MODEL),
                                               messages=[{"role": "user", "content": "hi"}], **kwargs)
            except error as exc:
                return exc
        raise AssertionError(f"expected {error.__name__}")

    return call()


def closed_port_url() -> str:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}"


async def until(predicate: Callable[[], bool], within_s: float) -> None:
    """Poll state the test cannot await (the simulator's model, metrics) until predicate holds;
    fails after within_s."""
    with trio.fail_after(within_s):
        for _ in range(int(within_s / 0.01) + 1):
            if predicate():
                return
            await trio.sleep(0.01)
        raise AssertionError("condition not reached")


def in_flight(sim) -> int:
    return sim.model.snapshot(trio.current_time()).in_flight


async def read_body(receive) -> bytes:
    body = b""
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return body
        body += message.get("body", b"")
        if not message.get("more_body", False):
            return body


async def until_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def sse(text: str) -> bytes:
    chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
             "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


# -- pure pieces -----------------------------------------------------------------------------


class FixedRng:
    def __init__(self, value: float) -> None:
        self.value = value

    def random(self) -> float:
        return self.value


@pytest.mark.parametrize(("hint", "draw", "expected"), [
    (0.0, 0.0, 1),       # clamped up to 1 s
    (0.2, 0.5, 2),       # 1 s + 12.5 % -> 2
    (1.0, 0.0, 1),
    (2.0, 0.0, 2),
    (2.0, 0.999, 3),     # 2 s + ~25 % -> 2.5 -> 3
    (4.0, 0.5, 5),       # 4.5 -> 5
    (10.0, 0.2, 11),     # 10.5 -> 11
    (60.0, 0.0, 60),
    (600.0, 0.0, 60),    # clamped down to 60 s
    (600.0, 0.999, 75),  # then jittered
    (float("inf"), 0.0, 60),
])
def test_retry_after_clamps_jitters_and_rounds_up(hint, draw, expected):
    assert retry_after_seconds(hint, FixedRng(draw)) == expected


def test_retry_after_is_jittered_not_constant():
    rng = random.Random(1)
    values = {retry_after_seconds(8.0, rng) for _ in range(200)}
    assert values == {9, 10}  # 8 s + 0..25 %, rounded up


@pytest.mark.parametrize(("endpoint", "path", "query", "url"), [
    ("http://h:8088/v1", "/v1/chat/completions", b"", "http://h:8088/v1/chat/completions"),
    ("http://h:8088/v1/", "/v1/completions", b"", "http://h:8088/v1/completions"),
    ("https://h/openai/v1", "/v1/embeddings", b"a=1", "https://h/openai/v1/embeddings?a=1"),
])
def test_local_target_joins_the_provider_base_and_the_path_after_v1(endpoint, path, query, url):
    target = upstream_target(Forward("a", "p", MODEL, local=LocalProvider("p", MODEL, endpoint)), path, query)
    assert str(target.url) == url and not target.remote and target.headers == ()


def test_local_target_carries_the_provider_credentials():
    bearer = upstream_target(local("a", "p", "http://h", auth_scheme="bearer", api_key="k1",
                                   headers={"X-Team": "t"}), "/v1/chat/completions")
    assert bearer.headers == ((b"x-team", b"t"), (b"authorization", b"Bearer k1"))
    assert "k1" not in repr(bearer)  # credentials stay out of logs
    header = upstream_target(local("a", "p", "http://h", auth_scheme="header", headers={"api-key": "k2"},
                                   timeout_s=12.0), "/v1/chat/completions")
    assert header.headers == ((b"api-key", b"k2"),) and header.timeout_s == 12.0


def test_remote_target_is_the_ingress_plus_the_whole_path_pinned_to_that_site():
    target = upstream_target(remote("b", "pb", "https://gw.b:8443/"), "/v1/chat/completions")
    assert str(target.url) == "https://gw.b:8443/v1/chat/completions"
    assert target.remote and target.timeout_s is None
    assert target.headers == ((PIN_HEADER.encode(), b"b"),)


def test_request_headers_drop_hop_by_hop_credentials_and_pins():
    client = [
        (b"host", b"gw"), (b"content-length", b"10"), (b"content-type", b"application/json"),
        (b"authorization", b"Bearer client"), (b"cookie", b"c=1"), (b"connection", b"keep-alive, x-hop"),
        (b"x-hop", b"1"), (b"keep-alive", b"timeout=5"), (b"te", b"trailers"), (b"x-gridd-site", b"a"),
        (b"Accept-Encoding", b"gzip"), (b"x-request-id", b"r1"), (b"x-team", b"client"),
    ]
    out = request_headers(client, ((b"x-team", b"provider"), (b"authorization", b"Bearer k")))
    assert out == [(b"content-type", b"application/json"), (b"accept-encoding", b"gzip"),
                   (b"x-request-id", b"r1"), (b"x-team", b"provider"), (b"authorization", b"Bearer k")]


def test_response_headers_drop_hop_by_hop_and_pass_content_length():
    upstream = [(b"Content-Type", b"text/event-stream"), (b"Transfer-Encoding", b"chunked"),
                (b"Connection", b"keep-alive"), (b"Retry-After", b"3")]
    relayed = [(b"content-type", b"text/event-stream"), (b"retry-after", b"3")]
    assert response_headers(upstream) == relayed
    assert response_headers([(b"content-length", b"42")]) == [(b"content-length", b"42")]
    assert response_headers([(b"content-length", b"x")]) == [(b"content-length", b"x")]


def test_the_front_takes_a_transport_not_a_client():
    with pytest.raises(TypeError, match="transport"):
        make_front_app(FakeRouter("a", always(UnknownModel())), httpx.AsyncClient(), CollectorRegistry(),
                       rng=random.Random(SEED))


# -- forwarding through two sites ------------------------------------------------------------


async def test_chat_through_two_sites_non_streamed_and_streamed(nursery):
    sim_a = await start_sim(nursery, ttft_s=0.0, tpot_s=0.001, max_tokens=8)
    sim_b = await start_sim(nursery, ttft_s=0.0, tpot_s=0.001, max_tokens=8)
    router_b = FakeRouter("b", always(local("b", "pb", sim_b.url)))
    front_b = await start_front(nursery, router_b)
    route = {"to": local("a", "pa", sim_a.url)}
    router_a = FakeRouter("a", lambda model, pinned, exclude: route["to"])
    front_a = await start_front(nursery, router_a)
    expected = "Lorem ipsum dolor sit amet, consectetur adipiscing"  # 8 tokens

    assert await trio.to_thread.run_sync(chat_text, front_a) == expected
    assert await trio.to_thread.run_sync(chat_stream_text, front_a) == expected
    assert sim_a.model.snapshot(trio.current_time()).pool.request_total == 2
    assert router_b.calls == []

    route["to"] = remote("b", "pb", front_b.url)
    assert await trio.to_thread.run_sync(chat_text, front_a) == expected
    assert await trio.to_thread.run_sync(chat_stream_text, front_a) == expected
    # Site b saw the pin (its router was asked for site b only) and served locally.
    assert router_b.calls == [(MODEL, "b", frozenset()), (MODEL, "b", frozenset())]
    assert sim_b.model.snapshot(trio.current_time()).pool.request_total == 2
    assert sim_a.model.snapshot(trio.current_time()).pool.request_total == 2
    assert all(call[1] is None for call in router_a.calls)

    await front_a.counted(4)
    await front_b.counted(2)
    assert front_a.requests("ok", site="a") == 2
    assert front_a.requests("ok", site="b") == 2
    assert front_b.requests("ok", site="b") == 2
    assert front_a.sample("gridd_gateway_upstream_latency_seconds_count", site="b") == 2
    assert front_a.sample("gridd_gateway_time_to_first_byte_seconds_count", site="a") == 2
    assert front_a.sample("gridd_gateway_retries_total", reason="connect") == 0


async def test_served_by_names_the_site_and_the_provider_that_answered(nursery):
    async def claims_to_be_elsewhere(scope, receive, send):
        # A local provider that sends the header itself cannot name itself: the gateway does.
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"x-gridd-served-by", b"z/zz")]})
        await send({"type": "http.response.body", "body": b"{}"})

    liar = await start_app(nursery, claims_to_be_elsewhere)
    sim_b = await start_sim(nursery, ttft_s=0.0, tpot_s=0.001, max_tokens=2)
    front_b = await start_front(nursery, FakeRouter("b", always(local("b", "pb-1", sim_b.url))))
    route = {"to": local("a", "pa", liar)}
    front_a = await start_front(nursery, FakeRouter("a", lambda model, pinned, exclude: route["to"]))
    async with httpx.AsyncClient(timeout=BOUND_S) as client:
        async def served_by() -> list[bytes]:
            r = await client.post(f"{front_a.url}/v1/chat/completions",
                                  json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200
            return [v for k, v in r.headers.raw if k.lower() == b"x-gridd-served-by"]

        assert await served_by() == [b"a/pa"]
        # Site a picked site b's "pb"; b's gateway served with its own pick, "pb-1", and said so.
        route["to"] = remote("b", "pb", front_b.url)
        assert await served_by() == [b"b/pb-1"]


async def test_completions_and_embeddings_pass_through(nursery):
    sim = await start_sim(nursery, ttft_s=0.0, tpot_s=0.0, max_tokens=3)
    front = await start_front(nursery, FakeRouter("a", always(local("a", "p", sim.url))))

    def call():
        with sdk(front) as client:
            text = client.completions.create(model=MODEL, prompt="abc").choices[0].text
            vectors = client.embeddings.create(model=MODEL, input=["x", "y"]).data
        return text, vectors

    text, vectors = await trio.to_thread.run_sync(call)
    assert text == "Lorem ipsum dolor" and len(vectors) == 2 and len(vectors[0].embedding) == 8


async def test_headers_reaching_providers_and_remote_sites(nursery):
    seen = []

    async def upstream(scope, receive, send):
        await read_body(receive)
        seen.append((scope["path"], scope["query_string"], dict(scope["headers"])))
        body = b'{"ok": true}'
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"x-upstream", b"1"), (b"connection", b"keep-alive")]})
        await send({"type": "http.response.body", "body": body})

    url = await start_app(nursery, upstream)
    route = {"to": local("a", "p", url + "/prefix", auth_scheme="bearer", api_key="provider-key",
                         headers={"X-Custom": "c"})}
    front = await start_front(nursery, FakeRouter("a", lambda model, pinned, exclude: route["to"]))
    async with httpx.AsyncClient() as client:
        headers = {"authorization": "Bearer client-key", "x-request-id": "r1", "cookie": "s=1",
                   "x-llm-d-inference-fairness-id": "tenant-1", "connection": "keep-alive, x-hop",
                   "x-hop": "1"}
        r = await client.post(f"{front.url}/v1/chat/completions?trace=1", json={"model": MODEL},
                              headers=headers)
        assert r.status_code == 200 and r.json() == {"ok": True}
        assert r.headers["x-upstream"] == "1"

        route["to"] = remote("b", "pb", url)
        r = await client.post(f"{front.url}/v1/chat/completions", json={"model": MODEL}, headers=headers)
        assert r.status_code == 200

    (path, query, sent), (remote_path, _, remote_sent) = seen
    assert path == "/prefix/v1/chat/completions" and query == b"trace=1"
    assert sent[b"authorization"] == b"Bearer provider-key" and sent[b"x-custom"] == b"c"
    assert sent[b"x-request-id"] == b"r1" and sent[b"x-llm-d-inference-fairness-id"] == b"tenant-1"
    assert b"cookie" not in sent and b"x-hop" not in sent and PIN_HEADER.encode() not in sent
    assert sent[b"content-type"] == b"application/json"
    assert remote_path == "/v1/chat/completions"
    assert remote_sent[PIN_HEADER.encode()] == b"b" and b"authorization" not in remote_sent


# -- decisions answered by the front ---------------------------------------------------------


async def test_shed_is_429_with_a_jittered_retry_after(nursery):
    front = await start_front(nursery, FakeRouter("a", always(Shed(retry_after_s=7.5))))
    exc = await trio.to_thread.run_sync(expect_error, front, openai.RateLimitError)
    assert exc.status_code == 429
    assert exc.response.headers["retry-after"] == str(retry_after_seconds(7.5, random.Random(SEED)))
    error = exc.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "rate_limit_exceeded" and error["code"] == "model_saturated"
    await front.counted(1)
    assert front.sample("gridd_gateway_sheds_total", model=MODEL) == 1
    assert front.requests("shed", site="none") == 1


async def test_unavailable_is_503_with_retry_after_not_404(nursery):
    front = await start_front(nursery, FakeRouter("a", always(Unavailable(retry_after_s=0.2))))
    exc = await trio.to_thread.run_sync(expect_error, front, openai.APIStatusError)
    assert exc.status_code == 503
    assert exc.response.headers["retry-after"] == str(retry_after_seconds(0.2, random.Random(SEED)))
    assert exc.response.json()["error"]["code"] == "model_unavailable"
    await front.counted(1)
    assert front.sample("gridd_gateway_unavailable_total", model=MODEL) == 1
    assert front.requests("unavailable", site="none") == 1


async def test_a_request_before_the_first_routing_data_waits_for_it(nursery):
    """A gateway just (re)started serves before its first poll lands: the request waits (up
    to first_data_wait_s) and is decided again on the data, instead of a 503."""
    asked = trio.Event()

    def rule(model, pinned, exclude):
        trio.lowlevel.current_trio_token().run_sync_soon(asked.set)
        if not router.had_data.is_set():
            return Unavailable(2.0, cause="no_operator_data")
        return Unavailable(retry_after_s=0.2)

    router = FakeRouter("a", rule)
    router.is_ready = False
    front = await start_front(nursery, router, limits=FrontLimits(first_data_wait_s=BOUND_S))
    async with trio.open_nursery() as inner:
        async def client():
            exc = await trio.to_thread.run_sync(expect_error, front, openai.APIStatusError)
            # decided again once the data came: the model's own answer, not "no routing data"
            assert exc.status_code == 503 and exc.response.json()["error"]["code"] == "model_unavailable"
        inner.start_soon(client)
        with trio.fail_after(BOUND_S):
            await asked.wait()
        router.had_data.set()
    assert len(router.calls) == 2


async def test_without_routing_data_the_wait_is_bounded_then_503_names_the_cause(nursery):
    router = FakeRouter("a", always(Unavailable(2.0, cause="no_operator_data")))
    router.is_ready = False
    front = await start_front(nursery, router, limits=FrontLimits(first_data_wait_s=0.2))
    exc = await trio.to_thread.run_sync(expect_error, front, openai.APIStatusError)
    assert exc.status_code == 503 and exc.response.json()["error"]["code"] == "no_routing_data"
    assert "no routing data from the operator" in exc.response.json()["error"]["message"]
    assert len(router.calls) == 1  # the data never came: no second decision


async def test_every_site_over_the_strategys_bounds_is_a_503_that_says_so(nursery):
    router = FakeRouter("a", always(Unavailable(retry_after_s=5.0, cause="strategy")))
    front = await start_front(nursery, router)
    exc = await trio.to_thread.run_sync(expect_error, front, openai.APIStatusError)
    assert exc.status_code == 503 and exc.response.json()["error"] == {
        "message": f"every site serving {MODEL!r} is over a bound of its routing strategy; retry later",
        "type": "service_unavailable", "param": None, "code": "model_unavailable"}
    assert exc.response.headers["retry-after"] == str(retry_after_seconds(5.0, random.Random(SEED)))


async def test_unknown_model_is_404_and_counted_as_other(nursery):
    front = await start_front(nursery, FakeRouter("a", always(Shed(1.0))))
    exc = await trio.to_thread.run_sync(lambda: expect_error(front, openai.NotFoundError, model="nope"))
    error = exc.response.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "retry-after" not in exc.response.headers
    await front.counted(1)
    assert front.requests("unknown_model", model="other", site="none") == 1
    assert front.sample("gridd_gateway_requests_total", model="nope", site="none",
                        outcome="unknown_model") == 0


async def test_models_health_readiness_metrics_and_routes(nursery):
    router = FakeRouter("a", always(Shed(1.0)), models=("m1", "m2"))
    front = await start_front(nursery, router)

    def list_models():
        with sdk(front) as client:
            return [(m.id, m.owned_by, m.created) for m in client.models.list()]

    assert await trio.to_thread.run_sync(list_models) == [("m1", "gridd", 1_700_000_000),
                                                        ("m2", "gridd", 1_700_000_000)]
    async with httpx.AsyncClient(base_url=front.url) as client:
        assert (await client.get("/healthz")).status_code == 200
        assert (await client.get("/readyz")).status_code == 200
        router.is_ready = False
        assert (await client.get("/readyz")).status_code == 503
        assert (await client.get("/healthz")).status_code == 200
        await client.post("/v1/chat/completions", json={"model": MODEL})
        metrics = await client.get("/metrics")
        series = 'gridd_gateway_requests_total{model="sim-model",outcome="shed",site="none"} 1.0'
        assert series in metrics.text
        missing = await client.get("/v1/nothing")
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "invalid_request_error"
        wrong = await client.get("/v1/chat/completions")
        assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
        assert wrong.json()["error"]["code"] == "method_not_allowed"
        assert (await client.post("/readyz")).status_code == 405


async def test_bad_requests_body_limit_and_misdirected_pins(nursery):
    sim = await start_sim(nursery, ttft_s=0.0, tpot_s=0.0, max_tokens=2)
    router = FakeRouter("a", always(local("a", "p", sim.url)))
    front = await start_front(nursery, router, limits=FrontLimits(max_body_bytes=1024))
    path = "/v1/chat/completions"
    async with httpx.AsyncClient(base_url=front.url) as client:
        r = await client.post(path, content=b'{"model": ')
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        r = await client.post(path, content=b'["model"]')
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = await client.post(path, json={"messages": []})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        r = await client.post(path, json={"model": 5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        r = await client.post(path, content=b'{"model": "' + b"x" * 1100 + b'"}')
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        async def chunked():
            for _ in range(3):
                yield b"x" * 500

        r = await client.post(path, content=chunked())
        assert r.status_code == 413
        r = await client.post(path, json={"model": MODEL, "messages": []}, headers={PIN_HEADER: "elsewhere"})
        assert r.status_code == 421 and r.json()["error"]["code"] == "misdirected_request"
        r = await client.post(path, json={"model": MODEL, "messages": []}, headers={PIN_HEADER: "a"})
        assert r.status_code == 200
    exc = await trio.to_thread.run_sync(lambda: expect_error(front, openai.BadRequestError, model=""))
    assert exc.response.json()["error"]["param"] == "model"
    assert router.calls == [(MODEL, "a", frozenset())]
    await front.counted(9)
    assert front.requests("bad_request", model="other", site="none") == 5
    assert front.requests("too_large", model="other", site="none") == 2
    assert front.requests("misdirected", model="other", site="none") == 1


# -- disconnects free the backend ------------------------------------------------------------


async def test_streamed_client_disconnect_frees_the_sequence_within_a_second(nursery):
    sim = await start_sim(nursery, ttft_s=0.0, tpot_s=0.05, max_tokens=400)
    front = await start_front(nursery, FakeRouter("a", always(local("a", "p", sim.url))))

    def read_two_then_leave() -> float:
        with sdk(front) as client:
            stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                    stream=True)
            next(iter(stream))
            next(iter(stream))
            stream.close()
        return time.monotonic()

    left_at = await trio.to_thread.run_sync(read_two_then_leave)
    await until(lambda: in_flight(sim) == 0, within_s=1.0)
    assert time.monotonic() - left_at < 1.0
    await until(lambda: front.requests("client_closed", site="a") == 1, within_s=1.0)


async def test_non_streamed_client_disconnect_frees_the_sequence(nursery):
    sim = await start_sim(nursery, ttft_s=30.0, tpot_s=0.0, max_tokens=2)
    front = await start_front(nursery, FakeRouter("a", always(local("a", "p", sim.url))))
    async with httpx.AsyncClient(timeout=0.3) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post(f"{front.url}/v1/chat/completions", json={"model": MODEL, "messages": []})
    left_at = trio.current_time()
    await until(lambda: in_flight(sim) == 0, within_s=1.0)
    assert trio.current_time() - left_at < 1.0


# -- retries and upstream failures -----------------------------------------------------------


async def test_upstream_closing_an_idle_pooled_connection_is_not_an_error(nursery):
    # The upstream drops keep-alive connections idle for 0.2 s; the pool must notice (the socket
    # reads as closed) and open a new one rather than fail or spend the retry. The pool polls a
    # connection idle for longer than unchecked_idle_s (1 s in the daemon; 0.1 s here, so that
    # the test need not wait seconds: tests/test_upstream_client.py asserts the bound itself).
    app = SimApp(knobs_from({"ttft_s": 0.0, "tpot_s": 0.0, "max_tokens": 2}))
    url = (await nursery.start(lambda task_status: serve_asgi(app, ["127.0.0.1:0"], keep_alive_s=0.2,
                                                              task_status=task_status)))[0]
    upstream = UpstreamClient(ssl_context=None, max_idle=16, keepalive_expiry_s=4.0, unchecked_idle_s=0.1)
    front = await start_front(nursery, FakeRouter("a", always(local("a", "p", url))), upstream=upstream)
    async with httpx.AsyncClient(timeout=5.0) as client:
        for _ in range(3):
            r = await client.post(f"{front.url}/v1/chat/completions", json={"model": MODEL, "messages": []})
            assert r.status_code == 200
            await trio.sleep(0.4)
    await front.counted(3)
    assert front.requests("ok", site="a") == 3
    assert front.sample("gridd_gateway_retries_total", reason="dropped") == 0


async def test_connect_failure_is_retried_once_on_the_next_candidate(nursery):
    sim = await start_sim(nursery, ttft_s=0.0, tpot_s=0.0, max_tokens=2)
    dead = local("a", "dead", closed_port_url())
    good = local("a", "good", sim.url)
    router = FakeRouter("a", lambda model, pinned, exclude: good if exclude else dead)
    front = await start_front(nursery, router)
    assert await trio.to_thread.run_sync(chat_text, front) == "Lorem ipsum"
    assert router.calls == [(MODEL, None, frozenset()), (MODEL, None, frozenset({("a", "dead")}))]
    await front.counted(1)
    assert front.sample("gridd_gateway_retries_total", reason="connect") == 1
    assert front.requests("ok", site="a") == 1


class ConnectsLate:
    """Requests to ``late_url`` get their connection only after the front's connect bound has
    passed, and the task does not get to a checkpoint meanwhile (a starved event loop: the
    shielded sleep); then the request is going out, and no answer ever comes. Everything else
    goes to ``inner``."""

    def __init__(self, late_url: str, inner: UpstreamClient, late_s: float) -> None:
        self.late_url, self.inner, self.late_s = late_url, inner, late_s

    async def open(self, target, client_headers, body, on_connected):
        if not str(target.url).startswith(self.late_url):
            return await self.inner.open(target, client_headers, body, on_connected)
        with trio.CancelScope(shield=True):
            await trio.sleep(self.late_s)
        on_connected()
        await trio.sleep(60)
        raise AssertionError("the front's bound should have ended this request")

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()


async def test_a_connection_ready_after_the_connect_bound_fired_is_a_connect_timeout_and_retried(nursery):
    """Soak finding (docs/reliability.md): under load a connection can become ready just after
    the connect bound fired but before the cancellation reached the task. The front then moved
    to the headers phase with the cancellation already pending, answered 504 `header_timeout`
    (naming the 300 s bound that never ran) and never retried. It is a connect timeout."""
    sim = await start_sim(nursery, ttft_s=0.0, tpot_s=0.0, max_tokens=2)
    late = local("a", "late", "http://192.0.2.1:9")  # never dialled: the transport stands in
    good = local("a", "good", sim.url)
    router = FakeRouter("a", lambda model, pinned, exclude: good if exclude else late)
    registry = CollectorRegistry()
    async with ConnectsLate("http://192.0.2.1:9", make_upstream_client(), late_s=0.4) as transport:
        app = make_front_app(router, transport, registry, rng=random.Random(SEED),
                             limits=FrontLimits(connect_s=0.2), created_unix=1_700_000_000)
        url = await start_app(nursery, app)
        async with httpx.AsyncClient(timeout=10.0) as client:
            r = await client.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 200, r.text
    assert r.headers["x-gridd-served-by"] == "a/good"
    assert router.calls == [(MODEL, None, frozenset()), (MODEL, None, frozenset({("a", "late")}))]
    assert registry.get_sample_value("gridd_gateway_retries_total", {"reason": "connect_timeout"}) == 1


async def test_5xx_before_the_first_byte_is_retried_and_streams_from_the_next(nursery):
    failing = await start_sim(nursery, status_5xx=500)
    sim = await start_sim(nursery, ttft_s=0.0, tpot_s=0.0, max_tokens=2)
    first, second = local("a", "failing", failing.url), local("a", "good", sim.url)
    router = FakeRouter("a", lambda model, pinned, exclude: second if exclude else first)
    front = await start_front(nursery, router)
    assert await trio.to_thread.run_sync(chat_stream_text, front) == "Lorem ipsum"
    assert dict(failing.model.snapshot(trio.current_time()).pool.errors) == {"ModelServerError": 1}
    await front.counted(1)
    assert front.sample("gridd_gateway_retries_total", reason="status") == 1


@pytest.mark.parametrize("second", ["dead", "none"])
async def test_no_upstream_answering_is_502_with_retry_after(nursery, second):
    dead = [local("a", "d1", closed_port_url()), local("a", "d2", closed_port_url())]

    def rule(model, pinned, exclude):
        if not exclude:
            return dead[0]
        return dead[1] if second == "dead" else UnknownModel()

    router = FakeRouter("a", rule)
    front = await start_front(nursery, router)
    exc = await trio.to_thread.run_sync(expect_error, front, openai.APIStatusError)
    assert exc.status_code == 502
    assert exc.response.headers["retry-after"] == str(retry_after_seconds(1.0, random.Random(SEED)))
    assert exc.response.json()["error"]["code"] == "upstream_unavailable"
    assert len(router.calls) == 2  # one retry, never more
    await front.counted(1)
    assert front.sample("gridd_gateway_retries_total", reason="connect") == 1
    assert front.requests("upstream_error", site="a") == 1


async def test_mid_stream_failure_reaches_the_client_as_a_terminated_stream(nursery):
    async def breaks_after_two_chunks(scope, receive, send):
        await read_body(receive)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": sse("one"), "more_body": True})
        await send({"type": "http.response.body", "body": sse("two"), "more_body": True})
        raise RuntimeError("upstream dies mid-stream")

    url = await start_app(nursery, breaks_after_two_chunks)
    front = await start_front(nursery, FakeRouter("a", always(local("a", "p", url))))

    def consume():
        received = []
        start = time.monotonic()
        with sdk(front, timeout=5.0) as client:
            stream = client.chat.completions.create(model=MODEL, messages=[], stream=True)
            try:
                for chunk in stream:
                    received.append(chunk.choices[0].delta.content)
            except openai.APIConnectionError as exc:  # the SDK's word for a body cut short
                return received, exc, time.monotonic() - start
        return received, None, time.monotonic() - start

    received, error, took = await trio.to_thread.run_sync(consume)
    assert received == ["one", "two"]
    assert error is not None and took < 2.0
    await until(lambda: front.requests("stream_error", site="a") == 1, within_s=1.0)
    # Never retried once a byte reached the client.
    assert front.sample("gridd_gateway_retries_total", reason="connect") == 0
    assert front.sample("gridd_gateway_retries_total", reason="status") == 0


async def test_idle_stream_is_cut_and_the_upstream_released(nursery):
    released = trio.Event()

    async def stalls_after_one_chunk(scope, receive, send):
        await read_body(receive)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": sse("one"), "more_body": True})
        await until_disconnect(receive)
        released.set()

    url = await start_app(nursery, stalls_after_one_chunk)
    front = await start_front(nursery, FakeRouter("a", always(local("a", "p", url))),
                              limits=FrontLimits(stream_idle_s=0.3))
    async with httpx.AsyncClient(timeout=5.0) as client:
        start = trio.current_time()
        body = b""
        with pytest.raises(httpx.RemoteProtocolError):
            async with client.stream("POST", f"{front.url}/v1/chat/completions",
                                     json={"model": MODEL, "stream": True}) as r:
                async for part in r.aiter_raw():
                    body += part
        assert 0.3 <= trio.current_time() - start < 2.0
    assert body == sse("one")
    with trio.fail_after(1.0):
        await released.wait()
    await front.counted(1)
    assert front.requests("stream_error", site="a") == 1


async def test_slow_headers_are_504_without_a_retry(nursery):
    released = trio.Event()

    async def never_answers(scope, receive, send):
        await read_body(receive)
        await until_disconnect(receive)
        released.set()

    url = await start_app(nursery, never_answers)
    router = FakeRouter("a", always(local("a", "p", url, timeout_s=0.3)))
    front = await start_front(nursery, router)
    async with httpx.AsyncClient(timeout=5.0) as client:
        start = trio.current_time()
        r = await client.post(f"{front.url}/v1/chat/completions", json={"model": MODEL})
        assert 0.3 <= trio.current_time() - start < 2.0
    assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
    assert r.headers["retry-after"] == str(retry_after_seconds(1.0, random.Random(SEED)))
    assert len(router.calls) == 1
    with trio.fail_after(1.0):
        await released.wait()
    await front.counted(1)
    assert front.requests("upstream_timeout", site="a") == 1


async def test_upstream_4xx_is_relayed_unchanged(nursery):
    sim = await start_sim(nursery)
    front = await start_front(nursery, FakeRouter("a", always(local("a", "p", sim.url))))
    async with httpx.AsyncClient(timeout=5.0) as client:
        r = await client.post(f"{front.url}/v1/chat/completions", json={"model": MODEL, "messages": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    await front.counted(1)
    assert front.requests("upstream_4xx", site="a") == 1


async def test_remote_ingress_over_mutual_tls(nursery):
    """The ingress transport speaks TLS with a client certificate (the gateways' mTLS)."""
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    server_ctx.verify_mode = ssl.CERT_REQUIRED
    ca.configure_trust(server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    ca.issue_cert("gateway.a").configure_cert(client_ctx)
    seen = []
    connections = []

    async def tls_ingress(stream: trio.SocketStream) -> None:
        # A minimal HTTP/1.1 responder over TLS: one JSON answer per request, keep-alive.
        connections.append(stream)
        tls = trio.SSLStream(stream, server_ctx, server_side=True)
        buffer = b""
        try:
            while True:
                while b"\r\n\r\n" not in buffer:
                    data = await tls.receive_some(65536)
                    if not data:
                        return
                    buffer += data
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                headers = dict(line.lower().split(b": ", 1) for line in lines[1:])
                length = int(headers.get(b"content-length", b"0"))
                while len(buffer) < length:
                    buffer += await tls.receive_some(65536)
                buffer = buffer[length:]
                seen.append((lines[0], headers.get(PIN_HEADER.encode()), tls.getpeercert()["subjectAltName"]))
                body = b'{"served": "b"}'
                await tls.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                                   + str(len(body)).encode() + b"\r\n\r\n" + body)
        except trio.BrokenResourceError:
            return

    listeners = await nursery.start(trio.serve_tcp, tls_ingress, 0)
    port = listeners[0].socket.getsockname()[1]
    ingress_url = f"https://127.0.0.1:{port}"
    front = await start_front(nursery, FakeRouter("a", always(remote("b", "pb", ingress_url))),
                              ingress_verify=client_ctx)
    async with httpx.AsyncClient(timeout=5.0) as client:
        for _ in range(2):
            r = await client.post(f"{front.url}/v1/chat/completions", json={"model": MODEL})
            assert r.status_code == 200 and r.json() == {"served": "b"}
    assert [line for line, _, _ in seen] == [b"POST /v1/chat/completions HTTP/1.1"] * 2
    assert all(pin == b"b" and san == (("DNS", "gateway.a"),) for _, pin, san in seen)
    assert len(connections) == 1  # the pooled TLS connection was reused

    # A transport that does not trust the ingress's CA cannot connect: retried, then 502.
    untrusting = ssl.create_default_context()
    trustme.CA().configure_trust(untrusting)
    other = await start_front(nursery, FakeRouter("a", always(remote("b", "pb", ingress_url))),
                              ingress_verify=untrusting)
    async with httpx.AsyncClient(timeout=5.0) as client:
        r = await client.post(f"{other.url}/v1/chat/completions", json={"model": MODEL})
    assert r.status_code == 502
    assert other.sample("gridd_gateway_retries_total", reason="connect") == 1


# -- the upstream pool -------------------------------------------------------------------------


async def discard(data: bytes, last: bool) -> None:
    pass


async def _exchange_once(transport, target) -> None:
    body = json.dumps({"model": MODEL, "stream": True, "messages": []}).encode()
    answer = await transport.open(target, [(b"content-type", b"application/json")], body, lambda: None)
    try:
        await answer.relay(discard)
    finally:
        await answer.aclose()


async def test_upstream_pool_reuses_connections_and_closes_idle_ones_at_keepalive_expiry(nursery, mock_clock):
    # Real loopback IO under a clock that moves only when told: 8 concurrent streams open 8
    # connections, the next 16 requests reuse them, and an idle one is trusted for exactly 4 s.
    sim = await start_sim(nursery, ttft_s=0.0, tpot_s=0.0, max_tokens=2)
    transport = make_upstream_client(keepalive_expiry_s=4.0)
    target = upstream_target(local("a", "p", sim.url), "/v1/chat/completions")
    try:
        async with trio.open_nursery() as batch:
            for _ in range(8):
                batch.start_soon(_exchange_once, transport, target)
        assert (transport.opened, transport.requests, transport.idle_count()) == (8, 8, 8)
        async with trio.open_nursery() as batch:
            for _ in range(8):
                batch.start_soon(_exchange_once, transport, target)
        for _ in range(8):
            await _exchange_once(transport, target)
        assert (transport.opened, transport.requests, transport.idle_count()) == (8, 24, 8)
        mock_clock.jump(3.5)
        assert await transport.close_expired() == 0
        await _exchange_once(transport, target)  # the most recently used one: trusted until 7.5
        mock_clock.jump(0.5)
        assert await transport.close_expired() == 7  # released at 0, expired at 4.0
        assert (transport.opened, transport.idle_count()) == (8, 1)
        mock_clock.jump(3.25)
        await _exchange_once(transport, target)  # 7.25: still trusted; now until 11.25
        assert transport.opened == 8
        mock_clock.jump(4.0)
        await _exchange_once(transport, target)  # 11.25: expired, closed, a new connection
        assert (transport.opened, transport.idle_count()) == (9, 1)
    finally:
        await transport.aclose()
    assert transport.idle_count() == 0



async def test_the_sweep_and_a_release_at_the_same_moment_share_the_idle_stack(nursery, mock_clock):
    # The sweep closes expired connections while a response is released into the same origin's
    # stack (which drops expired ones too): neither may trip over the other (the sweep used to
    # iterate the stack across its awaits and died with "deque mutated during iteration",
    # taking the gateway down in the certificate-rotation fault test).
    sim = await start_sim(nursery, ttft_s=0.0, tpot_s=0.0, max_tokens=2)
    transport = make_upstream_client(keepalive_expiry_s=4.0)
    target = upstream_target(local("a", "p", sim.url), "/v1/chat/completions")
    body = json.dumps({"model": MODEL, "messages": []}).encode()
    try:
        held = await transport.open(target, [(b"content-type", b"application/json")], body, lambda: None)
        await held.relay(discard)  # read whole; its connection goes back only when it is closed
        async with trio.open_nursery() as batch:
            for _ in range(2):
                batch.start_soon(_exchange_once, transport, target)
        assert (transport.opened, transport.idle_count()) == (3, 2)
        mock_clock.jump(4.0)  # every connection is past its keep-alive
        swept = []

        async def sweep() -> None:
            swept.append(await transport.close_expired())

        async with trio.open_nursery() as both:
            both.start_soon(sweep)
            both.start_soon(held.aclose)
        assert len(swept) == 1 and transport.idle_count() == 0
        await _exchange_once(transport, target)  # nothing expired was kept: a new connection
        assert (transport.opened, transport.idle_count()) == (4, 1)
    finally:
        await transport.aclose()

async def test_upstream_pool_drops_a_connection_the_server_closed(nursery):
    # The server closes idle keep-alive connections after 0.2 s: the pool sees the socket read
    # as closed and opens a new one, without an error (polled past unchecked_idle_s, 0.1 s here).
    app = SimApp(knobs_from({"ttft_s": 0.0, "tpot_s": 0.0, "max_tokens": 2}))
    url = (await nursery.start(lambda task_status: serve_asgi(app, ["127.0.0.1:0"], keep_alive_s=0.2,
                                                              task_status=task_status)))[0]
    transport = UpstreamClient(ssl_context=None, max_idle=16, keepalive_expiry_s=4.0, unchecked_idle_s=0.1)
    target = upstream_target(local("a", "p", url), "/v1/chat/completions")
    try:
        await _exchange_once(transport, target)
        await _exchange_once(transport, target)
        assert transport.opened == 1
        await trio.sleep(0.4)
        await _exchange_once(transport, target)
        assert (transport.opened, transport.requests) == (2, 3)
    finally:
        await transport.aclose()


async def test_front_reuses_upstream_connections_and_counts_them(nursery):
    sim = await start_sim(nursery, ttft_s=0.0, tpot_s=0.0, max_tokens=2)
    front = await start_front(nursery, FakeRouter("a", always(local("a", "p", sim.url))))
    async with httpx.AsyncClient(timeout=BOUND_S) as client:
        for stream in (False, True, False, True, False):
            r = await client.post(f"{front.url}/v1/chat/completions",
                                  json={"model": MODEL, "stream": stream, "messages": []})
            assert r.status_code == 200
    await front.counted(5)
    assert front.sample("gridd_gateway_upstream_requests_sent_total", upstream="provider") == 5
    assert front.sample("gridd_gateway_upstream_connections_opened_total", upstream="provider") == 1


async def test_events_that_arrive_together_are_relayed_in_one_send(nursery):
    # The upstream writes a head and 50 SSE events, each its own HTTP chunk, in one write (as a
    # backend's events pile up in the socket while the gateway is busy). The front relays them
    # in one piece: the client sees one chunk, not 50 (one send per event was the old relay).
    events = [sse(f"t{i}") for i in range(50)] + [SSE_DONE]
    answer = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
              + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n")

    async def upstream(stream):
        request = b""
        while b"\r\n\r\n" not in request or not request.endswith(b"}"):
            request += await stream.receive_some(65536)
        await stream.send_all(answer)
        await stream.receive_some(65536)  # the gateway closes or reuses; either way, done

    listeners = await nursery.start(functools.partial(trio.serve_tcp, upstream, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    front = await start_front(nursery, FakeRouter("a", always(local("a", "p", f"http://127.0.0.1:{port}"))))
    client = h11.Connection(h11.CLIENT)
    body = json.dumps({"model": MODEL, "stream": True, "messages": []}).encode()
    host, _, front_port = front.url.removeprefix("http://").rpartition(":")
    with trio.fail_after(BOUND_S):
        stream = await trio.open_tcp_stream(host, int(front_port))
        async with stream:
            await stream.send_all(client.send(h11.Request(
                method="POST", target="/v1/chat/completions",
                headers=[("host", "t"), ("content-type", "application/json"),
                         ("content-length", str(len(body)))]))
                + client.send(h11.Data(data=body)) + client.send(h11.EndOfMessage()))
            chunks = []
            while True:
                event = client.next_event()
                if event is h11.NEED_DATA:
                    client.receive_data(await stream.receive_some(65536))
                elif isinstance(event, h11.Data):
                    chunks.append(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage):
                    break
    assert b"".join(chunks) == b"".join(events)
    assert len(chunks) == 1


async def test_upstream_keepalive_counts_from_the_servers_last_bytes_not_from_release(nursery, mock_clock):
    # A response relayed to a slow client goes back to the pool long after the server sent its
    # last byte, and the server's keep-alive clock started then: the pool's must too.
    sim = await start_sim(nursery, ttft_s=0.0, tpot_s=0.0, max_tokens=2)
    transport = make_upstream_client(keepalive_expiry_s=4.0)
    target = upstream_target(local("a", "p", sim.url), "/v1/chat/completions")

    async def read_then_release_after(seconds: float) -> None:
        body = json.dumps({"model": MODEL, "messages": []}).encode()
        upstream = await transport.open(target, [(b"content-type", b"application/json")], body, lambda: None)
        received = []

        async def keep(data: bytes, last: bool) -> None:
            received.append(data)

        await upstream.relay(keep)
        assert b"".join(received)
        mock_clock.jump(seconds)  # the client is slow to take the last bytes
        await upstream.aclose()

    try:
        await read_then_release_after(3.5)  # last bytes at 0, released at 3.5
        assert transport.idle_count() == 1
        mock_clock.jump(0.25)
        assert await transport.close_expired() == 0  # 3.75
        mock_clock.jump(0.25)
        assert await transport.close_expired() == 1  # 4.0: 4 s after the last bytes
        await read_then_release_after(4.0)  # released exactly at expiry: closed, not pooled
        assert (transport.opened, transport.idle_count()) == (2, 0)
    finally:
        await transport.aclose()
