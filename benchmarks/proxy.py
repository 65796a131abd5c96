"""Benchmark the gateway front's forwarding overhead: the same load sent straight to a simulator
and through a gateway front that forwards every request to that simulator.

    .venv/bin/python benchmarks/proxy.py [--rounds 3] [--scale 1.0]

Processes: the simulator (gridd.sim, ttft 0, tpot 0, 16 tokens, room for every request) runs in
one child process, the front (gridd.gateway.front with a static router: every request goes
to that simulator as a local provider) in another; this parent drives load over loopback with
raw keep-alive sockets and a minimal HTTP/1.1 client, identical for both paths. With 2 or more
cores the simulator is pinned alone to CPU 1, so the backend is the same in both paths; the
front shares CPU 0 with the load generator.

Phases, each run against the simulator ("direct") and the front ("gateway") in every round,
the order alternating between rounds: non-streamed chat completions one at a time (latency),
streamed chat completions one at a time (time to the first body chunk), and non-streamed at a
fixed concurrency of 8 (throughput). Every phase is bounded by a request count and a time cap
(PHASE_CAP_S); a phase that hits the cap is flagged. Percentiles pool every round's samples;
throughput is the median of the rounds.

Last line: added_p50_ms=<gateway p50 - direct p50, non-streamed, milliseconds>.
"""

from __future__ import annotations

import argparse
import os
import random
import select
import statistics
import subprocess
import sys

import trio
from rawhttp import (  # benchmarks/ is sys.path[0] when run as a script
    Phase,
    PhaseResult,
    pct,
    run_phase,
    stop_child,
)

CHILD_START_CAP_S = 20.0
MODEL = "sim-model"
CHAT = b'{"model":"sim-model","messages":[{"role":"user","content":"Say something short."}]}'
CHAT_STREAM = (b'{"model":"sim-model","stream":true,'
               b'"messages":[{"role":"user","content":"Say something short."}]}')


# ---------------------------------------------------------------------------------------------
# Children


class StaticRouter:
    """Every request for MODEL goes to one local provider (the simulator)."""

    def __init__(self, site: str, upstream: str) -> None:
        from gridd.core.decisions import Forward, UnknownModel
        from gridd.wire import LocalProvider

        self.site = site
        self._forward = Forward(site, "sim", MODEL, local=LocalProvider("sim", MODEL, upstream + "/v1"))
        self._unknown = UnknownModel()

    def decide(self, model, *, pinned_site=None, exclude=frozenset()):
        if model != MODEL or (self.site, "sim") in exclude:
            return self._unknown
        return self._forward

    def models(self):
        return [MODEL]

    def ready(self):
        return True


def run_child(role: str, upstream: str | None, cpu: int | None) -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from prometheus_client import CollectorRegistry

    from gridd.gateway.forward import make_upstream_transport
    from gridd.gateway.front import make_front_app
    from gridd.httpserver import serve_asgi
    from gridd.sim import model as sim_model
    from gridd.sim.app import SimApp

    if cpu is not None:
        os.sched_setaffinity(0, {cpu})

    async def main():
        async with trio.open_nursery() as nursery:
            if role == "sim":
                app = SimApp(sim_model.knobs_from({"endpoints": 1, "max_seqs": 1024, "ttft_s": 0.0,
                                                   "tpot_s": 0.0, "max_tokens": 16, "model": MODEL}))
                urls = await nursery.start(serve_asgi, app, ["127.0.0.1:0"])
                print(urls[0], flush=True)
                return
            async with make_upstream_transport() as transport:
                app = make_front_app(StaticRouter("bench", upstream), transport, CollectorRegistry(),
                                     rng=random.Random(0))
                urls = await nursery.start(serve_asgi, app, ["127.0.0.1:0"])
                print(urls[0], flush=True)
                await trio.sleep_forever()

    trio.run(main)


def start_child(role: str, cpu: int | None, upstream: str | None = None) -> tuple[subprocess.Popen, str]:
    args = [sys.executable, os.path.abspath(__file__), "--serve", role]
    if upstream:
        args += ["--upstream", upstream]
    if cpu is not None:
        args += ["--cpu", str(cpu)]
    child = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    ready, _, _ = select.select([child.stdout], [], [], CHILD_START_CAP_S)
    if not ready:
        stop_child(child)
        raise RuntimeError(f"{role} did not start within {CHILD_START_CAP_S}s")
    return child, child.stdout.readline().strip()




# ---------------------------------------------------------------------------------------------
# Load side










def post(body: bytes) -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nUser-Agent: gridd-bench\r\n"
            b"Content-Type: application/json\r\nAuthorization: Bearer bench\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)




def phases(scale: float) -> list[Phase]:
    def n(count: int) -> int:
        return max(10, int(count * scale))

    return [
        Phase("chat_c1", post(CHAT), 1, n(1500)),
        Phase("stream_c1", post(CHAT_STREAM), 1, n(500)),
        Phase("chat_c8", post(CHAT), 8, n(300)),
    ]


def hostport(url: str) -> tuple[str, int]:
    host, _, port = url.removeprefix("http://").rpartition(":")
    return host, int(port)




def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--serve", choices=("sim", "front"))
    parser.add_argument("--upstream")
    parser.add_argument("--cpu", type=int)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply request counts")
    args = parser.parse_args()
    if args.serve:
        run_child(args.serve, args.upstream, args.cpu)
        return

    cpus = sorted(os.sched_getaffinity(0))
    load_cpu = cpus[0] if len(cpus) >= 2 else None
    sim_cpu = cpus[1] if len(cpus) >= 2 else None
    if load_cpu is not None:
        os.sched_setaffinity(0, {load_cpu})
    plan = phases(args.scale)
    paths = ("direct", "gateway")
    results: dict[str, dict[str, list[PhaseResult]]] = {p: {ph.key: [] for ph in plan} for p in paths}
    sim, sim_url = start_child("sim", sim_cpu)
    try:
        front, front_url = start_child("front", load_cpu, upstream=sim_url)
        try:
            targets = {"direct": hostport(sim_url), "gateway": hostport(front_url)}

            async def drive():
                for path in paths:  # warm-up: pools, caches, the front's upstream connections
                    await run_phase(*targets[path], post(CHAT), 8, max(10, int(100 * args.scale)))
                for round_no in range(args.rounds):
                    order = paths if round_no % 2 == 0 else tuple(reversed(paths))
                    for phase in plan:
                        for path in order:
                            results[path][phase.key].append(await run_phase(
                                *targets[path], phase.request, phase.concurrency, phase.per_conn))
                    print(f"round {round_no + 1}/{args.rounds} done", file=sys.stderr, flush=True)

            trio.run(drive)
        finally:
            stop_child(front)
    finally:
        stop_child(sim)

    def pooled(path: str, key: str, attr: str) -> list[float]:
        return [v for run in results[path][key] for v in getattr(run, attr)]

    def rate(path: str, key: str) -> float:
        return statistics.median(len(r.total_s) / r.wall_s for r in results[path][key])

    capped = sorted({key for path in paths for key, runs in results[path].items() if any(r.capped for r in runs)})
    print(f"# {len(cpus)} CPUs; simulator on CPU {sim_cpu}, front and load generator on CPU {load_cpu}; "
          f"{args.rounds} rounds, scale {args.scale}; python {sys.version.split()[0]}"
          + (f"; CAPPED: {', '.join(capped)}" if capped else ""))
    print("| phase | metric | direct | gateway | added |")
    print("|---|---|---|---|---|")
    rows = [
        ("chat_c1", "latency p50 ms", "total_s", 0.5),
        ("chat_c1", "latency p99 ms", "total_s", 0.99),
        ("stream_c1", "first chunk p50 ms", "first_s", 0.5),
        ("stream_c1", "first chunk p99 ms", "first_s", 0.99),
        ("stream_c1", "whole stream p50 ms", "total_s", 0.5),
    ]
    for key, label, attr, q in rows:
        direct, gateway = pct(pooled("direct", key, attr), q), pct(pooled("gateway", key, attr), q)
        print(f"| {key} | {label} | {direct:.3f} | {gateway:.3f} | {gateway - direct:+.3f} |")
    direct_rate, gateway_rate = rate("direct", "chat_c8"), rate("gateway", "chat_c8")
    print(f"| chat_c8 | req/s | {direct_rate:.0f} | {gateway_rate:.0f} | x{gateway_rate / direct_rate:.2f} |")
    added = pct(pooled("gateway", "chat_c1", "total_s"), 0.5) - pct(pooled("direct", "chat_c1", "total_s"), 0.5)
    print(f"added_p50_ms={added:.3f}")


if __name__ == "__main__":
    main()
