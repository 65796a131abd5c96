"""Per-request pick latency: gridd's precomputed snapshot against a naive per-request scan.

gridd: ordering builds one OrderedSnapshot per model off the request path; each request
calls selection.pick(snapshot, rng).
baseline ("naive scan"): each request walks the raw readings (LoadSignals plus learned
bound per candidate), recomputes in-flight and rho, sorts, finds the sites with room and
draws among them with random.choices, the way a router without a resolved order would.

Both run the same rules on the same candidates, one request at a time, timed one call at a
time with time.perf_counter_ns. Run: .venv/bin/python benchmarks/pick.py
The last line is machine-readable: pick_p50_us=<gridd p50 for 8 candidates>.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gridd.core.capacity import gateway_in_flight, saturated_with_work_waiting  # noqa: E402
from gridd.core.ordering import CandidateView, build_snapshot  # noqa: E402
from gridd.core.readings import LoadSignals, UnitLoad  # noqa: E402
from gridd.core.selection import pick  # noqa: E402

SIZES = (2, 8, 64)
ITERATIONS = 20_000  # per size and implementation (bounded: at most BUDGET_S of wall time)
WARMUP = 2_000
BUDGET_S = 5.0


def make_candidates(n: int, rng: random.Random) -> list[tuple[str, str, LoadSignals, float]]:
    """n candidates (site, provider, raw load, learned bound); most have room."""
    out = []
    for i in range(n):
        ready = rng.randint(1, 8)
        running = rng.uniform(0.0, 6.0)
        waiting = 0.0 if i % 5 else rng.uniform(0.0, 2.0)
        units = tuple(UnitLoad(f"ep{k}", running, waiting, rng.random()) for k in range(ready))
        load = LoadSignals(ready_endpoints=ready, units=units, avg_running=running, avg_waiting=waiting,
                           kv_mean=rng.uniform(0.1, 0.7), kv_spread=rng.uniform(0.0, 0.1))
        bound = ready * rng.uniform(5.0, 12.0)
        out.append((f"site{i}", "p", load, bound))
    return out


def to_views(cands: list[tuple[str, str, LoadSignals, float]]) -> list[CandidateView]:
    views = []
    for site, provider, load, bound in cands:
        in_flight = gateway_in_flight(load) or 0.0
        rho = max(in_flight / bound, (load.kv_mean or 0.0) + (load.kv_spread or 0.0))
        views.append(CandidateView(site=site, provider=provider, model="m", capacity=bound, rho=rho,
                                   full=saturated_with_work_waiting(rho, load),
                                   queue_depth=(load.avg_waiting or 0.0) * (load.ready_endpoints or 0)))
    return views


def naive_pick(cands: list[tuple[str, str, LoadSignals, float]], rng: random.Random) -> tuple[str, str]:
    """The baseline: everything from raw readings, per request."""
    scored = []
    for site, provider, load, bound in cands:
        units = load.ready_endpoints if load.ready_endpoints is not None else len(load.units)
        in_flight = ((load.avg_running or 0.0) + (load.avg_waiting or 0.0)) * units + load.flow_queue
        rho = max(in_flight / bound, (load.kv_mean or 0.0) + (load.kv_spread or 0.0))
        waiting = load.queue_full_units > 0 or load.flow_queue > 0 or (load.avg_waiting or 0.0) > 0
        depth = (load.avg_waiting or 0.0) * units + load.flow_queue
        scored.append((rho, -bound, depth, site, provider, bound, rho >= 1.0 and waiting))
    scored.sort()
    room = [s for s in scored if s[0] < 1.0]
    if len(room) >= 3:
        first = rng.choices(range(len(room)), weights=[s[5] for s in room])[0]
        rest = [k for k in range(len(room)) if k != first]
        second = rng.choices(rest, weights=[room[k][5] for k in rest])[0]
        a, b = room[first], room[second]
        win = b if b[0] < a[0] else a
    elif len(room) == 2:
        weights = [s[5] / (1.0 + s[0]) for s in room]
        win = rng.choices(room, weights=weights)[0]
    elif room:
        win = room[0]
    else:
        not_full = [s for s in scored if not s[6]] or scored
        win = min(not_full, key=lambda s: (s[1], s[2]))
    return win[3], win[4]


def measure(call, rng: random.Random) -> list[int]:
    for _ in range(WARMUP):
        call(rng)
    samples = []
    clock = time.perf_counter_ns
    deadline = clock() + int(BUDGET_S * 1e9)
    for _ in range(ITERATIONS):
        t0 = clock()
        call(rng)
        t1 = clock()
        samples.append(t1 - t0)
        if t1 > deadline:
            break
    return samples


def pct(samples: list[int], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000.0


def main() -> None:
    print(f"python {sys.version.split()[0]}; {ITERATIONS} timed calls per case after {WARMUP} warm-up")
    print(f"{'candidates':>10} {'impl':>12} {'p50_us':>8} {'p99_us':>8} {'mean_us':>8}  "
          "snapshot_build_p50_us")
    gridd_p50: dict[int, float] = {}
    for n in SIZES:
        cands = make_candidates(n, random.Random(n))
        views = to_views(cands)
        builds = []
        for _ in range(200):
            t0 = time.perf_counter_ns()
            snap = build_snapshot("m", views)
            builds.append(time.perf_counter_ns() - t0)
        build_us = statistics.median(builds) / 1000.0  # off the request path, once per ingest
        ours = measure(lambda rng, snap=snap: pick(snap, rng), random.Random(1234))
        naive = measure(lambda rng, cands=cands: naive_pick(cands, rng), random.Random(1234))
        gridd_p50[n] = pct(ours, 0.50)
        for name, samples, extra in (("gridd", ours, f"{build_us:.1f}"), ("naive-scan", naive, "-")):
            print(f"{n:>10} {name:>12} {pct(samples, 0.50):>8.2f} {pct(samples, 0.99):>8.2f} "
                  f"{statistics.fmean(samples) / 1000.0:>8.2f}  {extra}")
        print(f"{n:>10} {'speedup p50':>12} {pct(naive, 0.50) / pct(ours, 0.50):>8.1f}x  (room: "
              f"{len(snap.room)})")
    print(f"pick_p50_us={gridd_p50[8]:.2f}")


if __name__ == "__main__":
    main()
