"""Pure queueing model of one simulated serving pool (an EPP's pool, or one vLLM server).

No trio, no sockets: every method takes the current time as ``now`` (seconds, any
monotonic origin) and returns plain values, so the same code drives the HTTP simulator
(gridd.sim.app, which passes trio.current_time()) and virtual-time drivers that call
``advance(now)`` themselves.

The pool has ``endpoints`` serving units (EPP endpoints / vLLM data-parallel engines),
each running at most ``max_seqs`` sequences at once.

Request lifecycle::

    admit ──► running ───────────────► finish          (slot free: admission)
      │  ──► waiting (FIFO, per endpoint) ─► running   (no free slot, flow control off)
      │  ──► held (FIFO, pool-wide) ─► running         (no free slot, flow control on)
      └───► rejected                                   (injected 5xx, queue limit, no endpoints)
    cancel: removes the request wherever it is and frees its slot at once.

Rules the model encodes:

* Admission picks the endpoint with the fewest running + waiting requests, ties to the
  lowest index (the EPP's least-loaded pick).
* A request that starts at ``s`` emits its first token at ``s + ttft_s`` and its i-th
  token (0-based) at ``s + ttft_s + i * tpot_s``; it finishes with its last token at
  ``s + ttft_s + (n - 1) * tpot_s``. Queue wait comes on top (time before ``s``), so the
  measured streaming TPOT ``(e2e - ttft) / (n - 1)`` is exactly ``tpot_s``.
* A slot freed at ``t`` starts the head of that endpoint's waiting queue at ``t``; with
  flow control on, the head of the pool's held queue is dispatched to it instead.
  Invariant: with flow control on, requests are held only while no endpoint has a free slot.
* KV-cache usage of an endpoint = min(1, running / max_seqs): each running sequence
  reserves an equal share of the cache, so an endpoint is full exactly when every slot is.
* Injected failures are deterministic: ``error_ratio`` r fails request k (1-based, counting
  every completion request) when floor(k * r) > floor((k - 1) * r), i.e. exactly r of them.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec

from gridd.sim.counters import EndpointSnapshot, EngineTally, ModelSnapshot, PoolTally

# EPP error codes this model produces (request_error_total{error_code}).
BAD_REQUEST = "BadRequest"
NOT_FOUND = "NotFound"
MODEL_SERVER_ERROR = "ModelServerError"
RESOURCE_EXHAUSTED = "ResourceExhausted"
SERVICE_UNAVAILABLE = "ServiceUnavailable"

_EPS = 1e-9

Count = Annotated[int, msgspec.Meta(ge=0)]
Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=3600.0)]


class SimKnobs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Every run-time setting of the simulator (CLI flags and the /admin JSON use these names).

    Build instances with ``knobs_from`` so the constraints below are checked.
    """

    endpoints: Annotated[int, msgspec.Meta(ge=0, le=4096)] = 2
    max_seqs: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 8
    ttft_s: Seconds = 0.05
    tpot_s: Seconds = 0.01
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=65_536)] = 16
    flavour: Literal["epp", "vllm"] = "epp"
    pool: Annotated[str, msgspec.Meta(min_length=1, max_length=253)] = "sim-pool"
    model: Annotated[str, msgspec.Meta(min_length=1, max_length=512)] = "sim-model"
    zero_ready: bool = False
    stop_unit_series: bool = False
    huge_body: bool = False
    body_bytes: Annotated[int, msgspec.Meta(ge=0, le=64 * 1024 * 1024)] = 0
    metrics_hang: bool = False
    metrics_delay_s: Seconds = 0.0
    status_5xx: Annotated[int, msgspec.Meta(ge=0, le=599)] = 0
    error_ratio: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    flow_control: bool = False
    queue_limit: Count = 0


KNOB_NAMES = SimKnobs.__struct_fields__


def knobs_from(changes: dict[str, Any], base: SimKnobs | None = None) -> SimKnobs:
    """Validated knobs: ``base`` (defaults when None) with ``changes`` applied.

    Raises ValueError naming the offending field (msgspec's path, e.g. ``$.max_seqs``).
    """
    merged = msgspec.structs.asdict(base) if base is not None else {}
    merged.update(changes)
    try:
        knobs = msgspec.convert(merged, SimKnobs)
    except msgspec.ValidationError as exc:
        raise ValueError(str(exc)) from None
    if knobs.status_5xx and not 500 <= knobs.status_5xx <= 599:
        raise ValueError("Expected `int` 0 (off) or 500..599 - at `$.status_5xx`")
    return knobs



class Admission(msgspec.Struct, frozen=True):
    """What ``admit`` did with a request.

    outcome: running (started at once), waiting (queued at an endpoint), held (flow
    control), rejected (answer ``status`` now; ``error_code`` is the EPP error label).
    """

    request_id: str
    outcome: Literal["running", "waiting", "held", "rejected"]
    endpoint: int | None = None
    status: int = 200
    error_code: str | None = None


class RequestTiming(msgspec.Struct, frozen=True):
    """When a started request emits tokens: token i at first_token_at + i * tpot_s."""

    started_at: float
    first_token_at: float
    tpot_s: float
    output_tokens: int

    @property
    def finish_at(self) -> float:
        return self.first_token_at + (self.output_tokens - 1) * self.tpot_s


@dataclass(slots=True)
class _Request:
    request_id: str
    arrival: float
    output_tokens: int
    stream: bool
    prompt_tokens: int
    body_bytes: int
    phase: str = "new"
    endpoint: int | None = None
    dispatched_at: float | None = None
    started_at: float | None = None
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    first_token_at: float | None = None


def _started(req: _Request) -> float:
    """When a running request started (set by ``_start``, before it is running)."""
    assert req.started_at is not None
    return req.started_at


@dataclass(slots=True)
class _Endpoint:
    index: int
    running: dict[str, _Request] = field(default_factory=dict)
    waiting: deque[_Request] = field(default_factory=deque)
    retired: bool = False
    scheduled: int = 0
    stats: EngineTally = field(default_factory=EngineTally)

    @property
    def load(self) -> int:
        return len(self.running) + len(self.waiting)



class SimModel:
    """The queueing model. Not thread-safe; one trio task at a time drives it."""

    def __init__(self, knobs: SimKnobs, now: float) -> None:
        self.knobs = knobs
        self._endpoints: list[_Endpoint] = [_Endpoint(i) for i in range(knobs.endpoints)]
        self._departed: list[int] = []
        self._held: deque[_Request] = deque()
        self._requests: dict[str, _Request] = {}
        self._pool = PoolTally()
        self._reset_at = now
        self._completions_seen = 0

    # -- admission -------------------------------------------------------------------------

    def admit(self, now: float, request_id: str, *, output_tokens: int, stream: bool,
              prompt_tokens: int = 1, body_bytes: int = 0) -> Admission:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in the model")
        if output_tokens < 1:
            raise ValueError("output_tokens must be >= 1")
        knobs = self.knobs
        active = [ep for ep in self._endpoints if not ep.retired]

        injected = self._injected_status()
        if injected:
            if injected == 503:
                # The EPP answers 503 itself before scheduling: not in request_total.
                self._pool.error(SERVICE_UNAVAILABLE)
                return Admission(request_id, "rejected", status=503, error_code=SERVICE_UNAVAILABLE)
            # A model-server failure: scheduled (request_total) and then failed.
            self._pool.request_total += 1
            self._pool.error(MODEL_SERVER_ERROR)
            if active:
                target = min(active, key=lambda ep: (ep.load, ep.index))
                target.scheduled += 1
            return Admission(request_id, "rejected", status=injected, error_code=MODEL_SERVER_ERROR)

        if not active:
            self._pool.scheduling_failures += 1
            self._pool.error(SERVICE_UNAVAILABLE)
            if knobs.flow_control:
                self._pool.flow("RejectedNoEndpoints", 0.0)
            return Admission(request_id, "rejected", status=503, error_code=SERVICE_UNAVAILABLE)

        req = _Request(request_id, now, output_tokens, stream, max(0, prompt_tokens), max(0, body_bytes))
        target = min(active, key=lambda ep: (ep.load, ep.index))
        if len(target.running) < knobs.max_seqs:
            self._requests[request_id] = req
            self._dispatch(now, req, target)
            self._start(now, req, target)
            return Admission(request_id, "running", endpoint=target.index)

        if knobs.flow_control:
            if knobs.queue_limit and len(self._held) >= knobs.queue_limit * len(active):
                self._pool.flow("RejectedCapacity", 0.0)
                self._pool.error(RESOURCE_EXHAUSTED)
                return Admission(request_id, "rejected", status=429, error_code=RESOURCE_EXHAUSTED)
            req.phase = "held"
            self._held.append(req)
            self._requests[request_id] = req
            return Admission(request_id, "held")

        if knobs.queue_limit and len(target.waiting) >= knobs.queue_limit:
            self._pool.error(RESOURCE_EXHAUSTED)
            return Admission(request_id, "rejected", status=429, error_code=RESOURCE_EXHAUSTED)
        self._requests[request_id] = req
        self._dispatch(now, req, target)
        req.phase = "waiting"
        target.waiting.append(req)
        return Admission(request_id, "waiting", endpoint=target.index)

    def record_error(self, error_code: str) -> None:
        """Count a request the shell refused before admission (BadRequest, NotFound)."""
        self._pool.error(error_code)

    def _injected_status(self) -> int:
        knobs = self.knobs
        self._completions_seen += 1
        if knobs.status_5xx:
            return knobs.status_5xx
        k, r = self._completions_seen, knobs.error_ratio
        if r > 0 and math.floor(k * r + _EPS) > math.floor((k - 1) * r + _EPS):
            return 500
        return 0

    def _dispatch(self, now: float, req: _Request, ep: _Endpoint) -> None:
        """The EPP hands the request to an endpoint (scheduled: request_total)."""
        req.endpoint = ep.index
        req.dispatched_at = now
        ep.scheduled += 1
        self._pool.request_total += 1
        if self.knobs.flow_control or req.phase == "held":
            self._pool.flow("Dispatched", now - req.arrival)

    def _start(self, now: float, req: _Request, ep: _Endpoint) -> None:
        req.phase = "running"
        req.started_at = now
        req.ttft_s = self.knobs.ttft_s
        req.tpot_s = self.knobs.tpot_s
        ep.running[req.request_id] = req
        ep.stats.prompt_tokens += req.prompt_tokens

    def _fill(self, now: float, ep: _Endpoint) -> list[str]:
        """Start work on ``ep``'s free slots: its own queue first, then flow control's."""
        started: list[str] = []
        while len(ep.running) < self.knobs.max_seqs:
            if ep.waiting:
                req = ep.waiting.popleft()
            elif self._held and not ep.retired:
                req = self._held.popleft()
                self._dispatch(now, req, ep)
            else:
                break
            self._start(now, req, ep)
            started.append(req.request_id)
        if ep.retired and not ep.load:
            self._endpoints.remove(ep)
            self._departed.append(ep.index)
        return started

    # -- progress --------------------------------------------------------------------------

    def phase(self, request_id: str) -> str | None:
        """held | waiting | running, or None once the request left the model."""
        req = self._requests.get(request_id)
        return req.phase if req is not None else None

    def timing(self, request_id: str) -> RequestTiming | None:
        """Token schedule of a running request; None if it has not started (or left)."""
        req = self._requests.get(request_id)
        if req is None or req.started_at is None:
            return None
        return RequestTiming(req.started_at, req.started_at + req.ttft_s, req.tpot_s, req.output_tokens)

    def first_token(self, now: float, request_id: str) -> None:
        """The shell sent the first token to the client at ``now`` (streaming TTFT)."""
        req = self._requests.get(request_id)
        if req is not None and req.phase == "running" and req.first_token_at is None:
            req.first_token_at = now

    def finish(self, now: float, request_id: str, finished_reason: str = "length") -> list[str]:
        """A running request completed successfully at ``now``. Returns the ids it let start."""
        req = self._requests.get(request_id)
        if req is None or req.phase != "running":
            return []
        del self._requests[request_id]
        ep = self._endpoint(req.endpoint)
        del ep.running[request_id]
        self._observe_success(now, req, ep, finished_reason)
        return self._fill(now, ep)

    def cancel(self, now: float, request_id: str) -> list[str]:
        """The client went away: drop the request at once. Returns the ids it let start."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return []
        if req.phase == "held":
            self._held.remove(req)
            # EvictedContextCancelled is reported as ServiceUnavailable (epp-metrics.md s6).
            self._pool.flow("EvictedContextCancelled", now - req.arrival)
            self._pool.error(SERVICE_UNAVAILABLE)
            return []
        ep = self._endpoint(req.endpoint)
        ep.stats.success["abort"] += 1
        if req.phase == "waiting":
            ep.waiting.remove(req)
            if ep.retired and not ep.load:
                self._endpoints.remove(ep)
                self._departed.append(ep.index)
            return []
        del ep.running[request_id]
        ep.stats.generation_tokens += self._tokens_generated(now, req)
        return self._fill(now, ep)

    def advance(self, now: float) -> list[str]:
        """Virtual-time driver: finish every running request whose last token is due by ``now``.

        Each finishes at its own due time (reason ``length``) and the requests it lets start
        begin at that time, so the outcome equals an event-by-event simulation.
        Returns the finished ids in completion order.
        """
        done: list[str] = []
        while True:
            due: tuple[float, int, str] | None = None
            for order, ep in enumerate(self._endpoints):
                for req in ep.running.values():
                    at = _started(req) + req.ttft_s + (req.output_tokens - 1) * req.tpot_s
                    if at <= now + _EPS and (due is None or (at, order) < due[:2]):
                        due = (at, order, req.request_id)
            if due is None:
                return done
            self.finish(due[0], due[2], "length")
            done.append(due[2])

    def _tokens_generated(self, now: float, req: _Request) -> int:
        first = _started(req) + req.ttft_s
        if now + _EPS < first:
            return 0
        if req.tpot_s <= 0:
            return req.output_tokens
        return min(req.output_tokens, 1 + math.floor((now - first) / req.tpot_s + _EPS))

    def _observe_success(self, now: float, req: _Request, ep: _Endpoint, reason: str) -> None:
        n = req.output_tokens
        started = _started(req)
        engine_first = started + req.ttft_s
        client_first = req.first_token_at if req.first_token_at is not None else engine_first
        e2e = now - req.arrival
        pool = self._pool.histograms
        if req.stream:
            pool["ttft_stream"].observe(client_first - req.arrival)
        else:
            pool["ttft_nonstream"].observe(e2e)
        pool["duration"].observe(e2e)
        pool["ntpot"].observe(e2e / n)
        if req.stream and n > 1:
            tpot = (now - client_first) / (n - 1)
            pool["streaming_tpot"].observe(tpot)
            pool["streaming_itl"].observe(tpot, n - 1)

        stats = ep.stats
        stats.success[reason] = stats.success.get(reason, 0) + 1
        stats.generation_tokens += n
        eh = stats.histograms
        arrived = req.dispatched_at
        assert arrived is not None  # dispatched before it started
        eh["time_to_first_token_seconds"].observe(engine_first - arrived)
        eh["e2e_request_latency_seconds"].observe(now - arrived)
        eh["request_queue_time_seconds"].observe(started - arrived)
        eh["request_inference_time_seconds"].observe(now - started)
        eh["request_prefill_time_seconds"].observe(engine_first - started)
        eh["request_decode_time_seconds"].observe(now - engine_first)
        if n > 1:
            gap = (now - engine_first) / (n - 1)
            eh["inter_token_latency_seconds"].observe(gap, n - 1)
            eh["request_time_per_output_token_seconds"].observe(gap)

    def _endpoint(self, index: int | None) -> _Endpoint:
        for ep in self._endpoints:
            if ep.index == index:
                return ep
        raise KeyError(index)

    # -- control ---------------------------------------------------------------------------

    def reconfigure(self, now: float, knobs: SimKnobs) -> list[str]:
        """Apply new knobs. Returns the ids of requests whose state changed: started, or
        (released from flow control with no endpoint left) rejected and gone from the model.

        Growing ``endpoints`` revives draining endpoints first, then adds new ones. Shrinking
        retires the highest-index endpoints: they take no new work, drain what they hold and
        leave the pool once empty. Turning flow control off hands held requests to endpoint
        queues in arrival order. Running requests keep the ttft/tpot they started with.
        """
        old = self.knobs
        self.knobs = knobs
        ordered = sorted(self._endpoints, key=lambda ep: ep.index)
        active = [ep for ep in ordered if not ep.retired]
        if knobs.endpoints > len(active):
            for ep in ordered:
                if len(active) == knobs.endpoints:
                    break
                if ep.retired:
                    ep.retired = False
                    active.append(ep)
            next_index = max([ep.index + 1 for ep in ordered] + [i + 1 for i in self._departed] + [0])
            while len(active) < knobs.endpoints:
                ep = _Endpoint(next_index)
                if next_index in self._departed:
                    self._departed.remove(next_index)
                next_index += 1
                self._endpoints.append(ep)
                active.append(ep)
            self._endpoints.sort(key=lambda ep: ep.index)
        elif knobs.endpoints < len(active):
            for ep in sorted(active, key=lambda ep: ep.index)[knobs.endpoints:]:
                ep.retired = True
                if not ep.load:
                    self._endpoints.remove(ep)
                    self._departed.append(ep.index)

        woken: list[str] = []
        if old.flow_control and not knobs.flow_control:
            held, self._held = self._held, deque()
            for req in held:
                del self._requests[req.request_id]
                if self._requeue(now, req) != "waiting":
                    woken.append(req.request_id)
        for ep in list(self._endpoints):
            woken.extend(self._fill(now, ep))
        return woken

    def _requeue(self, now: float, req: _Request) -> str:
        """Place a released flow-control request on an endpoint (flow control now off)."""
        active = [ep for ep in self._endpoints if not ep.retired]
        if not active:
            self._pool.flow("EvictedNoEndpoints", now - req.arrival)
            self._pool.error(SERVICE_UNAVAILABLE)
            return "rejected"
        target = min(active, key=lambda ep: (ep.load, ep.index))
        self._requests[req.request_id] = req
        self._dispatch(now, req, target)
        if len(target.running) < self.knobs.max_seqs:
            self._start(now, req, target)
            return "running"
        req.phase = "waiting"
        target.waiting.append(req)
        return "waiting"

    def reset_counters(self, now: float) -> None:
        """An EPP/vLLM restart as a scraper sees it: every cumulative counter and histogram
        starts again from zero. Gauges (running, waiting, KV, held) keep their live values."""
        self._pool = PoolTally()
        for ep in self._endpoints:
            ep.stats = EngineTally()
            ep.scheduled = 0
        self._departed.clear()
        self._reset_at = now

    # -- reading ---------------------------------------------------------------------------

    def snapshot(self, now: float) -> ModelSnapshot:
        max_seqs = self.knobs.max_seqs
        endpoints = tuple(
            EndpointSnapshot(
                index=ep.index,
                running=len(ep.running),
                waiting=len(ep.waiting),
                kv_usage=min(1.0, len(ep.running) / max_seqs),
                inflight_tokens=sum(r.prompt_tokens for r in ep.running.values())
                + sum(r.prompt_tokens for r in ep.waiting),
                scheduled=ep.scheduled,
                retired=ep.retired,
                engine=ep.stats.view(),
            )
            for ep in self._endpoints
        )
        return ModelSnapshot(
            now=now,
            max_seqs=max_seqs,
            flow_control=self.knobs.flow_control,
            endpoints=endpoints,
            departed=tuple(sorted(self._departed)),
            flow_held=len(self._held),
            flow_held_bytes=sum(r.body_bytes for r in self._held),
            in_flight=sum(e.running + e.waiting for e in endpoints),
            counters_reset_at=self._reset_at,
            pool=self._pool.view(),
        )
