"""A seeded discrete-event simulation of a grid, driving gridd's real pure core.

What is simulated (everything a router cannot see is modelled here, everything it can see is
produced by gridd's own code):

- **Sites.** One provider per site: an EPP pool of serving units (endpoints), each with
  ``slots`` concurrent sequences and its own FIFO queue. The EPP dispatches each request on
  arrival to the unit with the least ``running + waiting`` (ties to a random unit) and never
  moves it afterwards, so one unit can queue behind a long request while another idles (the
  effect that made gridd's old hard bound ratchet down). Service time = prefill + decode, the
  decode time drawn from a heavy-tailed (lognormal) distribution; a request's KV footprint
  grows with its size, so KV usage is a second, noisy pressure reading.
- **Signals.** Each site's operator scrapes its provider every ``scrape_s`` (a text exposition
  rendered from the site's state: EPP pool gauges, per-endpoint queues and in-flight, or vLLM
  engine gauges) through gridd's real pipeline (``ProviderPublisher.on_scrape``: parse,
  derive, readiness, revision, sequence). Operators poll their peers every ``peer_poll_s``;
  gateways poll their operator every ``poll_s`` and feed gridd's real ``GatewayStore``
  (admission fences, capacity learner, ordering, shedding) with the relayed batches, ages
  added as a relay does. ``extra_delay_s`` delays every delivery (stale signals).
- **Requests.** Poisson arrivals (the same list, sizes included, for every policy of a cell:
  common random numbers), each to a gateway chosen uniformly. A gridd gateway calls
  ``GatewayStore.decide``; baselines pick by their own rule. A 429 or 503 is counted and the
  request is dropped (no client retry).

Nothing here sleeps or touches the network; one run is a few hundred thousand events.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from gridd.core.capacity import gateway_in_flight
from gridd.core.decisions import Forward, Shed, Unavailable, UnknownModel
from gridd.core.knobs import RoutingKnobs
from gridd.core.publication import ProviderPublisher
from gridd.core.store import GatewayStore
from gridd.wire import Batch, LocalProvider, ServingConfig, SiteIngress

FIRST_DATA_WAIT_S = 2.0  # gridd.gateway.front_limits.FrontLimits.first_data_wait_s
MODEL = "sim-model"
PROVIDER = "pool"
WALL_EPOCH = 1_900_000_000.0  # the simulated wall clock starts here (monotonic 0)


# -- configuration ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SiteSpec:
    name: str
    units: int
    slots: int = 4
    flavour: str = "epp"  # "epp" | "vllm"


@dataclass(frozen=True)
class Event:
    """A change to the world at time ``at`` (scale, slow-down, silence, gateway restart)."""

    at: float
    kind: str  # "units" | "speed" | "silent" | "restart_gateways" | "load"
    site: str = ""
    value: float = 0.0


@dataclass(frozen=True)
class Cell:
    """One simulated run: sites, offered load and signal timings."""

    sites: tuple[SiteSpec, ...]
    load: float  # offered load as a fraction of total true capacity (slots / mean service)
    duration_s: float = 600.0
    warmup_s: float = 60.0
    gateways_per_site: int = 2
    scrape_s: float = 1.0
    poll_s: float = 1.0
    peer_poll_s: float = 5.0
    extra_delay_s: float = 0.0
    mean_decode_s: float = 2.0
    decode_sigma: float = 1.0
    events: tuple[Event, ...] = ()
    bursts: tuple[tuple[float, float, float], ...] = ()  # (start, end, factor) on the arrival rate
    client_sites: tuple[str, ...] = ()  # sites whose gateways take client traffic (default: all)
    probe_s: float = 0.0  # > 0: each site's probe publishes performance.* every probe_s (spec 004)
    seed: int = 1


@dataclass(frozen=True)
class GriddKnobs:
    """The gateway store's routing knobs (config ``routing.*`` / ``availability.shedding.*``)."""

    store: dict = field(default_factory=lambda: {"shedding": True})


# -- the site model -----------------------------------------------------------------------------


class Request:
    __slots__ = ("rid", "arrival", "prefill_s", "decode_s", "kv_tokens", "gateway", "site",
                 "unit", "started", "policy_note")

    def __init__(self, rid: int, arrival: float, prefill_s: float, decode_s: float, kv_tokens: float,
                 gateway: int) -> None:
        self.rid = rid
        self.arrival = arrival
        self.prefill_s = prefill_s
        self.decode_s = decode_s
        self.kv_tokens = kv_tokens
        self.gateway = gateway
        self.site = -1
        self.unit = -1
        self.started = -1.0


class Unit:
    __slots__ = ("running", "waiting", "kv_used", "retired")

    def __init__(self) -> None:
        self.running = 0
        self.waiting: deque[Request] = deque()
        self.kv_used = 0.0
        self.retired = False

    def admits(self, req: Request, slots: int, kv_capacity: float) -> bool:
        """vLLM's scheduler: a free sequence slot and room for the request's KV blocks (an
        idle unit always takes one)."""
        return self.running < slots and (self.running == 0 or self.kv_used + req.kv_tokens <= kv_capacity)


class Site:
    def __init__(self, index: int, spec: SiteSpec, rng: random.Random, kv_per_slot: float) -> None:
        self.index = index
        self.spec = spec
        self.name = spec.name
        self.slots = spec.slots
        self.units = [Unit() for _ in range(spec.units)]
        self.rng = rng
        self.kv_capacity = spec.slots * kv_per_slot
        self.speed = 1.0  # service time multiplier

    @property
    def active(self) -> list[Unit]:
        return [u for u in self.units if not u.retired]

    def in_flight(self) -> int:
        return sum(u.running + len(u.waiting) for u in self.units)

    def capacity(self) -> int:
        return self.slots * len(self.active)

    def dispatch(self, req: Request) -> tuple[int, bool]:
        """EPP least-loaded dispatch: returns (unit index, started now)."""
        best: list[int] = []
        best_load = math.inf
        for i, u in enumerate(self.units):
            if u.retired:
                continue
            load = u.running + len(u.waiting)
            if load < best_load:
                best, best_load = [i], load
            elif load == best_load:
                best.append(i)
        i = best[0] if len(best) == 1 else self.rng.choice(best)
        unit = self.units[i]
        req.unit = i
        if not unit.waiting and unit.admits(req, self.slots, self.kv_capacity):
            unit.running += 1
            unit.kv_used += req.kv_tokens
            return i, True
        unit.waiting.append(req)
        return i, False

    def exposition(self) -> bytes:
        """The site's /metrics as its EPP (or vLLM) would render it at this instant."""
        units = [u for u in self.units if not u.retired]
        kv = [min(1.0, u.kv_used / self.kv_capacity) for u in units]
        if self.spec.flavour == "vllm":
            lines = []
            for i, u in enumerate(units):
                lab = f'engine="{i}",model_name="{MODEL}"'
                lines.append(f"vllm:num_requests_running{{{lab}}} {float(u.running)}")
                lines.append(f"vllm:num_requests_waiting{{{lab}}} {float(len(u.waiting))}")
                lines.append(f"vllm:kv_cache_usage_perc{{{lab}}} {kv[i]}")
            return ("\n".join(lines) + "\n").encode()
        pool = 'name="sim-pool"'
        n = len(units)
        lines = [f"llm_d_epp_ready_endpoints{{{pool}}} {n}"]
        if n:
            running = [u.running for u in units]
            queue = [len(u.waiting) for u in units]
            mean_kv = sum(kv) / n
            sd_kv = math.sqrt(sum((x - mean_kv) ** 2 for x in kv) / (n - 1)) if n > 1 else 0.0
            # The EPP rounds its pool means and std devs to 2 decimals (v0.10).
            lines += [
                f"llm_d_epp_average_running_requests{{{pool}}} {round(sum(running) / n, 2)}",
                f"llm_d_epp_average_queue_size{{{pool}}} {round(sum(queue) / n, 2)}",
                f"llm_d_epp_average_kv_cache_utilization{{{pool}}} {round(mean_kv, 2)}",
                f"llm_d_epp_std_dev_kv_cache_utilization{{{pool}}} {round(sd_kv, 2)}",
            ]
            for i, u in enumerate(units):
                ep = f"10.0.{self.index}.{i}:8000"
                lines.append(f'llm_d_epp_per_endpoint_queue_size{{model_server_endpoint="{ep}",{pool}}} '
                             f"{len(u.waiting)}")
                lines.append(f'llm_d_epp_inflight_requests{{endpoint_name="{ep}",namespace="sim",'
                             f'producer_name="inflight-load"}} {u.running + len(u.waiting)}')
        return ("\n".join(lines) + "\n").encode()


# -- results ------------------------------------------------------------------------------------


def percentile(values: list[float], p: float) -> float:
    if not values:
        return math.nan
    s = sorted(values)
    k = (len(s) - 1) * p
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass
class Result:
    policy: str
    waits: list[float] = field(default_factory=list)
    waits_by_site: dict[str, list[float]] = field(default_factory=dict)
    ttfts: list[float] = field(default_factory=list)
    served_by_site: dict[str, int] = field(default_factory=dict)
    completed: int = 0
    shed: int = 0
    unavailable: int = 0
    not_found: int = 0
    measured_s: float = 0.0
    capacity_share: dict[str, float] = field(default_factory=dict)

    @property
    def p50_wait(self) -> float:
        return percentile(self.waits, 0.50)

    @property
    def p99_wait(self) -> float:
        return percentile(self.waits, 0.99)

    @property
    def p99_ttft(self) -> float:
        return percentile(self.ttfts, 0.99)

    @property
    def queued(self) -> float:
        return sum(1 for w in self.waits if w > 1e-9) / len(self.waits) if self.waits else 0.0

    @property
    def throughput(self) -> float:
        return self.completed / self.measured_s if self.measured_s else 0.0

    def share(self, site: str) -> float:
        total = sum(self.served_by_site.values())
        return self.served_by_site.get(site, 0) / total if total else 0.0


# -- policies -----------------------------------------------------------------------------------


class Policy:
    """One gateway's routing rule. ``choose`` returns a site index, or a string outcome
    ("429", "503", "404")."""

    name = "policy"

    def __init__(self, world: World, gateway: int) -> None:
        self.world = world
        self.gateway = gateway

    def ingest(self, batches: list[Batch], now: float) -> None:  # noqa: B027 - optional hook
        pass

    def sent(self, site: int) -> None:  # noqa: B027
        pass

    def done(self, site: int) -> None:  # noqa: B027
        pass

    def restart(self, now: float) -> None:  # noqa: B027
        pass

    def choose(self, now: float) -> int | str:
        raise NotImplementedError


class GriddPolicy(Policy):
    name = "gridd"

    def __init__(self, world: World, gateway: int) -> None:
        super().__init__(world, gateway)
        self.rng = random.Random(world.cell.seed * 1000 + gateway)
        self.restart(0.0)

    def restart(self, now: float) -> None:
        w = self.world
        own = w.sites[w.gateway_site[self.gateway]].name
        self.store = GatewayStore(site=own, knobs=RoutingKnobs(**w.gridd_knobs.store))
        self.had_data = False
        self.store.set_serving(ServingConfig(
            providers=(LocalProvider(provider=PROVIDER, model=MODEL, endpoint_url=f"http://{own}"),),
            ingresses=tuple(SiteIngress(s.name, f"https://{s.name}") for s in w.sites if s.name != own)))

    def ingest(self, batches: list[Batch], now: float) -> None:
        self.store.ingest(batches, now=now, now_wall=WALL_EPOCH + now)
        self.had_data = self.had_data or self.store.has_routing_data(now)

    def choose(self, now: float) -> int | str:
        decision = self.store.decide(MODEL, now=now, rng=self.rng)
        if isinstance(decision, Forward):
            return self.world.site_index[decision.site]
        if isinstance(decision, Shed):
            return "429"
        if isinstance(decision, Unavailable):
            # The front holds a request that comes before the gateway's first routing data
            # (FrontLimits.first_data_wait_s) instead of answering 503 at once.
            if decision.cause == "no_operator_data" and not self.had_data:
                return "wait"
            return "503"
        assert isinstance(decision, UnknownModel)
        return "404"


class StaticSplit(Policy):
    """Oracle: a random split by each site's true capacity (slots), known in advance."""

    name = "static"

    def __init__(self, world: World, gateway: int) -> None:
        super().__init__(world, gateway)
        self.rng = random.Random(world.cell.seed * 1000 + gateway + 17)

    def choose(self, now: float) -> int | str:
        caps = [s.capacity() for s in self.world.sites]
        return self.rng.choices(range(len(caps)), weights=caps)[0]


class WeightedRoundRobin(Policy):
    """Smooth weighted round-robin by true capacity (nginx's algorithm)."""

    name = "wrr"

    def __init__(self, world: World, gateway: int) -> None:
        super().__init__(world, gateway)
        self.current = [0.0] * len(world.sites)

    def choose(self, now: float) -> int | str:
        caps = [s.capacity() for s in self.world.sites]
        total = sum(caps)
        for i, c in enumerate(caps):
            self.current[i] += c
        best = max(range(len(caps)), key=lambda i: self.current[i])
        self.current[best] -= total
        return best


class GreedyLeastLoaded(Policy):
    """The least in-flight per unit of true capacity on the latest relayed readings (the same
    stale snapshot gridd gets); ties at random."""

    name = "greedy"

    def __init__(self, world: World, gateway: int) -> None:
        super().__init__(world, gateway)
        self.rng = random.Random(world.cell.seed * 1000 + gateway + 29)
        self.loads: dict[int, float] = {}

    def restart(self, now: float) -> None:
        self.loads = {}

    def ingest(self, batches: list[Batch], now: float) -> None:
        for b in batches:
            if b.load is None or b.age_s > 20.0:
                continue
            in_flight = gateway_in_flight(b.load)
            if in_flight is None:
                continue
            site = self.world.site_index[b.site]
            self.loads[site] = in_flight / max(1, self.world.sites[site].capacity())

    def choose(self, now: float) -> int | str:
        if not self.loads:
            return self.rng.randrange(len(self.world.sites))
        low = min(self.loads.values())
        return self.rng.choice([s for s, v in self.loads.items() if v == low])


class LeastBusy(Policy):
    """Each gateway's own count of its requests in flight per site, over true capacity
    (weighted least-connections); ties at random."""

    name = "least_busy"

    def __init__(self, world: World, gateway: int) -> None:
        super().__init__(world, gateway)
        self.rng = random.Random(world.cell.seed * 1000 + gateway + 31)
        self.outstanding = [0] * len(world.sites)

    def sent(self, site: int) -> None:
        self.outstanding[site] += 1

    def done(self, site: int) -> None:
        self.outstanding[site] -= 1

    def choose(self, now: float) -> int | str:
        caps = [max(1, s.capacity()) for s in self.world.sites]
        scores = [(o + 1) / c for o, c in zip(self.outstanding, caps, strict=True)]
        low = min(scores)
        return self.rng.choice([i for i, v in enumerate(scores) if v == low])


class UniformRandom(Policy):
    name = "random"

    def __init__(self, world: World, gateway: int) -> None:
        super().__init__(world, gateway)
        self.rng = random.Random(world.cell.seed * 1000 + gateway + 37)

    def choose(self, now: float) -> int | str:
        return self.rng.randrange(len(self.world.sites))


POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (GriddPolicy, StaticSplit, WeightedRoundRobin, GreedyLeastLoaded, LeastBusy,
                        UniformRandom)
}


# -- arrivals -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arrival:
    at: float
    gateway: int
    prefill_s: float
    decode_s: float
    kv_tokens: float


def make_arrivals(cell: Cell, n_gateways: int, client_gateways: list[int]) -> list[Arrival]:
    """Poisson arrivals at ``load`` x total capacity / mean service time (burst factors applied
    by thinning a process at the peak rate), each with its own size."""
    rng = random.Random(cell.seed)
    total_slots = sum(s.units * s.slots for s in cell.sites)
    mean_prefill = 0.1
    mean_service = cell.mean_decode_s + mean_prefill
    base_rate = cell.load * total_slots / mean_service
    peak = max([1.0] + [f for _, _, f in cell.bursts])
    mu = math.log(cell.mean_decode_s) - cell.decode_sigma ** 2 / 2
    out: list[Arrival] = []
    t = 0.0
    end = cell.duration_s
    while True:
        t += rng.expovariate(base_rate * peak)
        if t >= end:
            break
        factor = 1.0
        for start, stop, f in cell.bursts:
            if start <= t < stop:
                factor = f
        accept = rng.random() < factor / peak
        decode = min(60.0, rng.lognormvariate(mu, cell.decode_sigma))
        prefill = mean_prefill * rng.uniform(0.5, 1.5)
        gateway = rng.choice(client_gateways)
        if accept:
            # KV footprint ~ prompt + generated tokens: grows with the request's size (one slot's
            # worth on average, at most two).
            out.append(Arrival(t, gateway, prefill, decode,
                               0.5 + 0.5 * min(decode / cell.mean_decode_s, 3.0)))
    return out


# -- the world ----------------------------------------------------------------------------------


class World:
    def __init__(self, cell: Cell, policy: str, gridd_knobs: GriddKnobs | None = None) -> None:
        self.cell = cell
        self.gridd_knobs = gridd_knobs or GriddKnobs()
        rng = random.Random(cell.seed + 7)
        self.sites = [Site(i, spec, random.Random(cell.seed * 31 + i), kv_per_slot=1.5)
                      for i, spec in enumerate(cell.sites)]
        self.site_index = {s.name: s.index for s in self.sites}
        self.gateway_site = [i for i in range(len(self.sites)) for _ in range(cell.gateways_per_site)]
        client_sites = set(cell.client_sites or [s.name for s in cell.sites])
        self.client_gateways = [g for g, s in enumerate(self.gateway_site)
                                if self.sites[s].name in client_sites]
        self.policies = [POLICIES[policy](self, g) for g in range(len(self.gateway_site))]
        self.result = Result(policy)
        total = sum(s.capacity() for s in self.sites)
        self.result.capacity_share = {s.name: s.capacity() / total for s in self.sites}
        self.silent: set[int] = set()
        # Operator state: the publisher per site, the latest local batch with its scrape time,
        # and per operator the peers' batches as last polled.
        self.publishers = [
            ProviderPublisher(site=s.name, provider=PROVIDER, model=MODEL, provider_uid=f"uid-{s.name}",
                              generation=1, publisher_epoch=1_800_000_000 + s.index, created_at=0.0,
                              next_sequence=_counter())
            for s in self.sites
        ]
        self.local: list[tuple[Batch, float] | None] = [None] * len(self.sites)
        self.held: list[dict[int, tuple[Batch, float]]] = [{} for _ in self.sites]
        self.heap: list[tuple[float, int, int, Callable[[float], None]]] = []
        self._seq = 0
        # Phases: each periodic loop starts at a random offset within its period.
        for s in self.sites:
            self._every(cell.scrape_s, rng.uniform(0, cell.scrape_s), lambda now, s=s: self._scrape(now, s))
            for p in self.sites:
                if p is not s:
                    self._every(cell.peer_poll_s, rng.uniform(0, cell.peer_poll_s),
                                lambda now, s=s, p=p: self._peer_poll(now, s, p))
        for g in range(len(self.gateway_site)):
            self._every(cell.poll_s, rng.uniform(0, cell.poll_s), lambda now, g=g: self._gateway_poll(now, g))
        if cell.probe_s > 0:
            # Its own phases (a separate generator: cells without probes keep their phases).
            probe_rng = random.Random(cell.seed + 11)
            for s in self.sites:
                self._every(cell.probe_s, probe_rng.uniform(0, cell.probe_s),
                            lambda now, s=s: self._probe(now, s))
        for ev in cell.events:
            self._at(ev.at, lambda now, ev=ev: self._apply(now, ev), prio=0)
        self.arrivals = make_arrivals(cell, len(self.gateway_site), self.client_gateways)

    # scheduling ---------------------------------------------------------------------------------

    def _at(self, t: float, fn: Callable[[float], None], prio: int = 1) -> None:
        self._seq += 1
        heapq.heappush(self.heap, (t, prio, self._seq, fn))

    def _every(self, period: float, first: float, fn: Callable[[float], None]) -> None:
        def tick(now: float) -> None:
            fn(now)
            self._at(now + period, tick)
        self._at(first, tick)

    # signals ------------------------------------------------------------------------------------

    def _scrape(self, now: float, site: Site) -> None:
        pub = self.publishers[site.index]
        batch = pub.on_scrape(now=now, wall_now=WALL_EPOCH + now, body=site.exposition(), failure_class=None,
                              stale_after_s=10.0, unavailable=False)
        self.local[site.index] = (batch, now)
        self.held[site.index][site.index] = (batch, now)

    def _probe(self, now: float, site: Site) -> None:
        """Spec 004 Example 1's probe with ``aggregate: {method: latest}``: the site's waiting
        requests and mean KV use, into its publisher's metadata (``prefix: performance``)
        as the probe runner's metadata sink does; every later batch carries them."""
        pub = self.publishers[site.index]
        units = site.active
        kv = sum(min(1.0, u.kv_used / site.kv_capacity) for u in units) / len(units) if units else 0.0
        pub.probes.update({"performance.num_requests_waiting": float(sum(len(u.waiting) for u in units)),
                           "performance.kv_cache_usage_perc": kv})
        pub.probes_at.update(dict.fromkeys(pub.probes, now))

    def _peer_poll(self, now: float, operator: Site, peer: Site) -> None:
        if peer.index in self.silent:
            return  # the peer's operator does not answer: what operator holds keeps ageing
        latest = self.local[peer.index]
        if latest is not None:
            self.held[operator.index][peer.index] = latest

    def _gateway_poll(self, now: float, g: int) -> None:
        operator = self.gateway_site[g]
        snapshot = list(self.held[operator].values())
        delay = self.cell.extra_delay_s

        def deliver(at: float) -> None:
            batches = [msgspec.structs.replace(b, age_s=at - taken) for b, taken in snapshot]
            self.policies[g].ingest(batches, at)

        if delay > 0:
            self._at(now + delay, deliver)
        else:
            deliver(now)

    # world events -------------------------------------------------------------------------------

    def _apply(self, now: float, ev: Event) -> None:
        if ev.kind == "restart_gateways":
            for p in self.policies:
                p.restart(now)
            return
        site = self.sites[self.site_index[ev.site]]
        if ev.kind == "units":
            target = int(ev.value)
            active = site.active
            if target > len(active):
                for u in site.units:
                    if u.retired and len(site.active) < target:
                        u.retired = False
                while len(site.active) < target:
                    site.units.append(Unit())
            else:
                for u in active[target:]:
                    u.retired = True  # drains what it holds, takes nothing new
        elif ev.kind == "speed":
            site.speed = ev.value
        elif ev.kind == "silent":
            if ev.value:
                self.silent.add(site.index)
            else:
                self.silent.discard(site.index)

    # requests -----------------------------------------------------------------------------------

    def _start(self, now: float, site: Site, req: Request) -> None:
        req.started = now
        service = (req.prefill_s + req.decode_s) * site.speed
        if req.arrival >= self.cell.warmup_s:
            self.result.waits.append(now - req.arrival)
            self.result.waits_by_site.setdefault(site.name, []).append(now - req.arrival)
            self.result.ttfts.append(now - req.arrival + req.prefill_s * site.speed)
        self._at(now + service, lambda t, site=site, req=req: self._finish(t, site, req))

    def _finish(self, now: float, site: Site, req: Request) -> None:
        unit = site.units[req.unit]
        unit.running -= 1
        unit.kv_used -= req.kv_tokens
        while unit.waiting and unit.admits(unit.waiting[0], site.slots, site.kv_capacity):
            nxt = unit.waiting.popleft()
            unit.running += 1
            unit.kv_used += nxt.kv_tokens
            self._start(now, site, nxt)
        self.policies[req.gateway].done(site.index)
        if req.arrival >= self.cell.warmup_s:
            self.result.completed += 1

    def _arrive(self, now: float, a: Arrival, rid: int) -> None:
        req = Request(rid, a.at, a.prefill_s, a.decode_s, a.kv_tokens, a.gateway)
        choice = self.policies[a.gateway].choose(now)
        measured = a.at >= self.cell.warmup_s
        if choice == "wait":
            if now - a.at < FIRST_DATA_WAIT_S:
                self._at(now + 0.05, lambda t, a=a, rid=rid: self._arrive(t, a, rid), prio=2)
                return
            choice = "503"
        if isinstance(choice, str):
            if measured:
                if choice == "429":
                    self.result.shed += 1
                elif choice == "503":
                    self.result.unavailable += 1
                else:
                    self.result.not_found += 1
            return
        site = self.sites[choice]
        req.site = choice
        self.policies[a.gateway].sent(choice)
        if measured:
            self.result.served_by_site[site.name] = self.result.served_by_site.get(site.name, 0) + 1
        _, started = site.dispatch(req)
        if started:
            self._start(now, site, req)

    def run(self) -> Result:
        for rid, a in enumerate(self.arrivals):
            self._at(a.at, lambda now, a=a, rid=rid: self._arrive(now, a, rid), prio=2)
        end = self.cell.duration_s
        heap = self.heap
        while heap:
            t, _, _, fn = heapq.heappop(heap)
            if t > end:
                break
            fn(t)
        # Requests still waiting at the end count with the wait they have had so far (a
        # policy must not look better for leaving its worst queue unfinished).
        for site in self.sites:
            for unit in site.units:
                for req in unit.waiting:
                    if req.arrival >= self.cell.warmup_s:
                        self.result.waits.append(end - req.arrival)
                        self.result.ttfts.append(end - req.arrival)
        self.result.measured_s = end - self.cell.warmup_s
        return self.result


def _counter() -> Callable[[], int]:
    n = 0

    def next_sequence() -> int:
        nonlocal n
        n += 1
        return n
    return next_sequence


def simulate(cell: Cell, policy: str, gridd_knobs: GriddKnobs | None = None) -> Result:
    return World(cell, policy, gridd_knobs).run()
