"""The simulator's HTTP face: a raw ASGI app over the pure model (gridd.sim.model).

Routes:
    GET  /metrics                       EPP or vLLM exposition (knob ``flavour``)
    POST /v1/chat/completions           OpenAI-compatible; ``stream: true`` gives SSE
    POST /v1/completions                legacy completions, same pacing
    POST /v1/embeddings                 deterministic vectors; occupies a slot for ttft_s
    GET  /v1/models                     the one served model
    GET  /health                        200 while serving
    GET  /admin, POST /admin            knobs as JSON; POST merges, ``"restart": true`` resets counters

Every request really occupies the model: admitted on arrival, waiting (or held by flow
control) until a slot frees, running while its tokens are paced out with
``trio.sleep_until`` on the model's schedule, and removed at its last token or as soon as
the client disconnects (``http.disconnect`` from receive, or a failed send). Time is
``trio.current_time()``, so tests on trio's MockClock drive it exactly.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import struct
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import trio

from gridd.http.asgi import Receive, Send, answer_lifespan
from gridd.http.serve import serve_asgi
from gridd.sim import model as m
from gridd.sim.metrics import CONTENT_TYPE, PoolStats, render_metrics

REQUEST_BODY_LIMIT = 1 << 20
ADMIN_BODY_LIMIT = 64 * 1024
EMBEDDING_DIMENSIONS = 8
RETRY_AFTER_S = "1"
# Stand-in vocabulary: token i of every answer is _WORDS[i % len(_WORDS)].
_WORDS = ("Lorem", " ipsum", " dolor", " sit", " amet", ",", " consectetur", " adipiscing", " elit", ".")

_json = msgspec.json.Encoder()
_decode_json = msgspec.json.Decoder()

_INFERENCE_ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completion",
                     "/v1/embeddings": "embedding"}
_KNOWN_PATHS = {"/metrics", "/v1/models", "/health", "/admin", *_INFERENCE_ROUTES}

_ERROR_TYPES = {
    400: "BadRequestError", 404: "NotFoundError", 405: "BadRequestError", 413: "BadRequestError",
    429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError",
}


class _ClientGone(Exception):
    """The client disconnected (or a send failed) while we were answering."""


class _BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def error_body(status: int, message: str, *, code: str | None = None, param: str | None = None) -> bytes:
    """OpenAI-shaped error JSON."""
    return _json.encode({"error": {"message": message, "type": _ERROR_TYPES.get(status, "APIError"),
                                   "param": param, "code": code}})


def estimate_prompt_tokens(payload: dict[str, Any], kind: str) -> int:
    """About four characters per token, at least one (token-id lists count exactly)."""
    if kind == "chat":
        chars = 0
        for message in payload.get("messages") or ():
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                chars += sum(len(p.get("text", "")) for p in content if isinstance(p, dict))
        return max(1, math.ceil(chars / 4))
    source = payload.get("prompt") if kind == "completion" else payload.get("input")
    if isinstance(source, list) and source and all(isinstance(t, int) for t in source):
        return len(source)
    texts = [source] if isinstance(source, str) else [t for t in source or () if isinstance(t, str)]
    return max(1, math.ceil(sum(len(t) for t in texts) / 4))


def embedding_vector(text: str) -> list[float]:
    """A deterministic unit-length vector derived from the text's SHA-256."""
    digest = hashlib.sha256(text.encode()).digest()
    raw = [v / 2**31 - 1.0 for v in struct.unpack(f">{EMBEDDING_DIMENSIONS}I", digest)]
    norm = math.sqrt(sum(v * v for v in raw)) or 1.0
    return [round(v / norm, 6) for v in raw]


class SimApp:
    """ASGI callable serving one simulated pool. Create it inside a trio run."""

    def __init__(self, knobs: m.SimKnobs | None = None) -> None:
        knobs = knobs if knobs is not None else m.knobs_from({})
        self.model = m.SimModel(knobs, trio.current_time())
        self._started: dict[str, trio.Event] = {}
        self._latched: PoolStats | None = None
        self._created_unix = time.time()
        self._ids = itertools.count(1)

    @property
    def knobs(self) -> m.SimKnobs:
        return self.model.knobs

    def set_knobs(self, **changes: Any) -> m.SimKnobs:
        """Validate and apply knob changes now (raises ValueError naming the bad field)."""
        knobs = m.knobs_from(changes, self.model.knobs)
        self._wake(self.model.reconfigure(trio.current_time(), knobs))
        return knobs

    def restart(self) -> None:
        """Behave like a restarted EPP/vLLM to scrapers: counters from zero, no latched gauges."""
        self.model.reset_counters(trio.current_time())
        self._latched = None
        self._created_unix = time.time()

    def metrics_body(self) -> bytes:
        body, self._latched = render_metrics(self.model.snapshot(trio.current_time()), self.knobs,
                                             latched=self._latched, created_unix=self._created_unix)
        return body

    def _wake(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            event = self._started.get(rid)
            if event is not None:
                event.set()

    # -- ASGI ------------------------------------------------------------------------------

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        try:
            if path == "/metrics" and method == "GET":
                await self._serve_metrics(receive, send)
            elif path in _INFERENCE_ROUTES and method == "POST":
                await self._serve_inference(_INFERENCE_ROUTES[path], receive, send)
            elif path == "/v1/models" and method == "GET":
                await self._serve_models(send)
            elif path == "/health" and method == "GET":
                await _send_json(send, 200, b"{}")
            elif path == "/admin" and method in ("GET", "POST"):
                await self._serve_admin(method, receive, send)
            elif path in _KNOWN_PATHS:
                await _send_json(send, 405, error_body(405, f"{method} not allowed on {path}"))
            else:
                await _send_json(send, 404, error_body(404, f"no route {path}"))
        except _ClientGone:
            return

    # -- /metrics --------------------------------------------------------------------------

    async def _serve_metrics(self, receive: Receive, send: Send) -> None:
        knobs = self.knobs
        if knobs.metrics_hang:
            # Never answer: hold the request until the scraper gives up.
            await _until_disconnect(receive)
            return
        if knobs.metrics_delay_s:
            with trio.move_on_after(knobs.metrics_delay_s):
                await _until_disconnect(receive)
                return
        await _send_response(send, 200, self.metrics_body(), CONTENT_TYPE)

    # -- /v1/models, /admin ----------------------------------------------------------------

    async def _serve_models(self, send: Send) -> None:
        created = int(self._created_unix)
        await _send_json(send, 200, _json.encode({"object": "list", "data": [
            {"id": self.knobs.model, "object": "model", "created": created, "owned_by": "gridd-sim"}]}))

    def admin_state(self) -> dict[str, Any]:
        snap = self.model.snapshot(trio.current_time())
        return {
            "knobs": msgspec.structs.asdict(self.knobs),
            "endpoints": [{"index": e.index, "running": e.running, "waiting": e.waiting,
                           "kv_usage": e.kv_usage, "retired": e.retired} for e in snap.endpoints],
            "flow_held": snap.flow_held,
            "in_flight": snap.in_flight,
            "request_total": snap.pool.request_total,
            "errors": dict(snap.pool.errors),
        }

    async def _serve_admin(self, method: str, receive: Receive, send: Send) -> None:
        if method == "GET":
            await _send_json(send, 200, _json.encode(self.admin_state()))
            return
        body = await _read_body(receive, ADMIN_BODY_LIMIT)
        try:
            if body is None:
                raise ValueError("body larger than 64 KiB")
            changes = _decode_json.decode(body) if body.strip() else {}
            if not isinstance(changes, dict):
                raise ValueError("expected a JSON object of knob names to values")
            restart = changes.pop("restart", False)
            if not isinstance(restart, bool):
                raise ValueError("Expected `bool` - at `$.restart`")
            knobs = m.knobs_from(changes, self.knobs)
        except (ValueError, msgspec.DecodeError) as exc:
            await _send_json(send, 400, error_body(400, str(exc), code="invalid_knobs"))
            return
        self._wake(self.model.reconfigure(trio.current_time(), knobs))
        if restart:
            self.restart()
        await _send_json(send, 200, _json.encode(self.admin_state()))

    # -- inference -------------------------------------------------------------------------

    async def _serve_inference(self, kind: str, receive: Receive, send: Send) -> None:
        body = await _read_body(receive, REQUEST_BODY_LIMIT)
        if body is None:
            self.model.record_error(m.BAD_REQUEST)
            await _send_json(send, 413, error_body(413, "request body larger than 1 MiB"))
            return
        try:
            payload, output_tokens, reason = self._parse(kind, body)
        except _BadRequest as exc:
            self.model.record_error(m.BAD_REQUEST)
            await _send_json(send, 400, error_body(400, str(exc), param=exc.param))
            return
        requested = payload.get("model") or self.knobs.model
        if requested != self.knobs.model:
            self.model.record_error(m.NOT_FOUND)
            await _send_json(send, 404, error_body(404, f"The model `{requested}` does not exist.",
                                                   code="model_not_found", param="model"))
            return

        stream = kind != "embedding" and bool(payload.get("stream", False))
        prefix = {"chat": "chatcmpl", "completion": "cmpl", "embedding": "embd"}[kind]
        rid = f"{prefix}-sim-{next(self._ids)}"
        prompt_tokens = estimate_prompt_tokens(payload, kind)
        admission = self.model.admit(trio.current_time(), rid, output_tokens=output_tokens, stream=stream,
                                     prompt_tokens=prompt_tokens, body_bytes=len(body))
        if admission.outcome == "rejected":
            await self._send_rejection(send, admission)
            return

        started = trio.Event()
        self._started[rid] = started
        if admission.outcome == "running":
            started.set()
        finished = False
        answer = _Answer(kind, rid, self.knobs.model, int(time.time()), output_tokens, prompt_tokens, reason,
                         payload)
        try:
            async with trio.open_nursery() as nursery:
                # A client disconnect cancels the work at once; the finally frees the slot.
                nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
                try:
                    if stream:
                        finished = await self._stream(answer, started, send)
                    else:
                        finished = await self._respond(answer, started, send)
                except _ClientGone:
                    pass
                nursery.cancel_scope.cancel()
        finally:
            self._started.pop(rid, None)
            if not finished:
                self._wake(self.model.cancel(trio.current_time(), rid))

    def _parse(self, kind: str, body: bytes) -> tuple[dict[str, Any], int, str]:
        try:
            payload = _decode_json.decode(body)
        except msgspec.DecodeError as exc:
            raise _BadRequest(f"invalid JSON: {exc}") from None
        if not isinstance(payload, dict):
            raise _BadRequest("expected a JSON object")
        if kind == "chat" and not isinstance(payload.get("messages"), list):
            raise _BadRequest("`messages` must be a list", "messages")
        if kind == "completion" and not isinstance(payload.get("prompt"), (str, list)):
            raise _BadRequest("`prompt` must be a string or a list", "prompt")
        if kind == "embedding":
            if not isinstance(payload.get("input"), (str, list)):
                raise _BadRequest("`input` must be a string or a list", "input")
            return payload, 1, "stop"
        if not isinstance(payload.get("stream", False), bool):
            raise _BadRequest("`stream` must be a boolean", "stream")
        limit = payload.get("max_completion_tokens", payload.get("max_tokens"))
        if limit is None:
            return payload, self.knobs.max_tokens, "stop"
        if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= 65_536:
            raise _BadRequest("`max_tokens` must be an integer in 1..65536", "max_tokens")
        # A client-set bound is what ends the answer, as a real engine reports it.
        return payload, limit, "length"

    async def _send_rejection(self, send: Send, admission: m.Admission) -> None:
        status = admission.status
        if status == 429:
            message, code = "the pool's queues are full", "rate_limit_exceeded"
        elif status == 503:
            message, code = "no endpoint can serve the request", "service_unavailable"
        else:
            message, code = "the model server failed", "model_server_error"
        headers = [(b"retry-after", RETRY_AFTER_S.encode())] if status in (429, 503) else []
        await _send_json(send, status, error_body(status, message, code=code), headers)

    async def _wait_start(self, answer: _Answer, started: trio.Event) -> m.RequestTiming | None:
        await started.wait()
        return self.model.timing(answer.rid)

    async def _stream(self, answer: _Answer, started: trio.Event, send: Send) -> bool:
        # Headers go out on admission, as an OpenAI server starts its event stream at once.
        await _safe_send(send, {"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
        timing = await self._wait_start(answer, started)
        if timing is None:
            # Released from flow control with no endpoint left: end the stream with an error.
            await _safe_send(send, {"type": "http.response.body", "more_body": False, "body": _sse(
                {"error": {"message": "no endpoint can serve the request", "type": "ServiceUnavailableError",
                           "param": None, "code": "service_unavailable"}}) + b"data: [DONE]\n\n"})
            return True
        for i in range(answer.output_tokens):
            await trio.sleep_until(timing.first_token_at + i * timing.tpot_s)
            if i == 0:
                self.model.first_token(trio.current_time(), answer.rid)
            last = i == answer.output_tokens - 1
            await _safe_send(send, {"type": "http.response.body", "more_body": True,
                                    "body": _sse(answer.chunk(i, last))})
        self._wake(self.model.finish(trio.current_time(), answer.rid, answer.reason))
        tail = b""
        options = answer.payload.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            tail = _sse(answer.usage_chunk())
        await _safe_send(send, {"type": "http.response.body", "body": tail + b"data: [DONE]\n\n",
                                "more_body": False})
        return True

    async def _respond(self, answer: _Answer, started: trio.Event, send: Send) -> bool:
        timing = await self._wait_start(answer, started)
        if timing is None:
            await _send_json(send, 503, error_body(503, "no endpoint can serve the request",
                                                   code="service_unavailable"),
                             [(b"retry-after", RETRY_AFTER_S.encode())])
            return True
        await trio.sleep_until(timing.finish_at)
        self._wake(self.model.finish(trio.current_time(), answer.rid, answer.reason))
        await _send_json(send, 200, _json.encode(answer.whole()))
        return True


@dataclass(frozen=True, slots=True)
class _Answer:
    """The deterministic content of one answer."""

    kind: str
    rid: str
    model: str
    created: int
    output_tokens: int
    prompt_tokens: int
    reason: str
    payload: dict[str, Any]

    def usage(self) -> dict[str, int]:
        completion = 0 if self.kind == "embedding" else self.output_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    def chunk(self, i: int, last: bool) -> dict[str, Any]:
        word = _WORDS[i % len(_WORDS)]
        finish = self.reason if last else None
        if self.kind == "chat":
            delta = {"role": "assistant", "content": word} if i == 0 else {"content": word}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": word, "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                "choices": [choice]}

    def usage_chunk(self) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": [],
                "usage": self.usage()}

    def whole(self) -> dict[str, Any]:
        if self.kind == "embedding":
            source = self.payload.get("input")
            if isinstance(source, list) and source and all(isinstance(t, int) for t in source):
                texts = [" ".join(map(str, source))]
            elif isinstance(source, list):
                texts = [t if isinstance(t, str) else str(t) for t in source]
            else:  # a string: the request was refused otherwise (`input` must be a string or a list)
                texts = [str(source)]
            return {"object": "list", "model": self.model, "usage": self.usage(), "data": [
                {"object": "embedding", "index": i, "embedding": embedding_vector(t)}
                for i, t in enumerate(texts)]}
        text = "".join(_WORDS[i % len(_WORDS)] for i in range(self.output_tokens))
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": self.reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": self.reason}
            obj = "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                "choices": [choice], "usage": self.usage()}


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


async def _safe_send(send: Send, message: dict) -> None:
    try:
        await send(message)
    except (OSError, RuntimeError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        raise _ClientGone() from exc


async def _send_response(send: Send, status: int, body: bytes, content_type: str,
                         headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await _safe_send(send, {"type": "http.response.start", "status": status, "headers": [
        (b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode()),
        *(headers or [])]})
    await _safe_send(send, {"type": "http.response.body", "body": body, "more_body": False})


async def _send_json(send: Send, status: int, body: bytes,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await _send_response(send, status, body, "application/json", headers)


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole request body, or None past ``limit``; raises _ClientGone on disconnect."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size <= limit:
            chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks) if size <= limit else None


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _cancel_on_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    await _until_disconnect(receive)
    scope.cancel()


# -- in-process helper ---------------------------------------------------------------------


@dataclass(frozen=True)
class SimHandle:
    """A simulator served on loopback inside the caller's nursery."""

    url: str
    app: SimApp

    @property
    def model(self) -> m.SimModel:
        return self.app.model

    @property
    def knobs(self) -> m.SimKnobs:
        return self.app.knobs

    def set_knobs(self, **changes: Any) -> m.SimKnobs:
        return self.app.set_knobs(**changes)


async def start_sim(nursery: trio.Nursery, *, host: str = "127.0.0.1", port: int = 0,
                    **knobs: Any) -> SimHandle:
    """Serve a simulator on ``host:port`` (an ephemeral port by default) until ``nursery``
    is cancelled; returns once it accepts connections."""
    app = SimApp(m.knobs_from(knobs))
    urls = await nursery.start(serve_asgi, app, [f"{host}:{port}"])
    return SimHandle(url=urls[0], app=app)
