"""Benchmark the gateway front's forwarding overhead: the same load sent straight to a simulator
and through a gateway front that forwards every request to that simulator.

    .venv/bin/python benchmarks/proxy.py [--rounds 3] [--scale 1.0] [--src DIR] [--replicas N]

Processes: the simulator (gridd.sim, ttft 0, tpot 0, 16 tokens, room for every request) runs in
one child process, the front (gridd.gateway.front with a static router: every request goes
to that simulator as a local provider) in another; this parent drives load over loopback with
raw keep-alive sockets and a minimal HTTP/1.1 client, identical for both paths. With 2 or more
cores the simulator is pinned alone to CPU 1, so the backend is the same in both paths; the
front shares CPU 0 with the load generator.

Phases, each run against the simulator ("direct") and the front ("gateway") in every round,
the order alternating between rounds: non-streamed and streamed chat completions at
concurrency 1, 16 and 64 (keep-alive connections, about 1000 requests per phase at scale 1;
1500 non-streamed at concurrency 1 for the latency figure). Every phase is bounded by a
request count and a time cap (PHASE_CAP_S); a phase that hits the cap is flagged.
Percentiles pool every round's samples; throughput and the front's CPU per request (utime +
stime of the front process from /proc around the phase) are medians of the rounds.
The load generator's own CPU per request (its thread's CPU time over the gateway phase) is
printed too: it shares the front's core, so what it spends caps the front's throughput.

``--replicas N`` runs N front processes sharing one port (SO_REUSEPORT, as
``listen.http_reuse_port``), pinned one per CPU in turn; CPU per request sums them.

``--src DIR`` imports gridd from another checkout in the front's children (e.g. an export of
an older commit), so an old and a new front are measured by the same script against the same
simulator (always this checkout's: the backend is the fixture).

Last two lines: rps_c64=<gateway req/s, non-streamed, concurrency 64> and
added_p50_ms=<gateway p50 - direct p50, non-streamed, concurrency 1, milliseconds>.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import resource
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
)

# gridd is imported inside the functions, never at module level: a child (--serve) must
# import it from --src, which it can only do if no gridd module was loaded before.

CHILD_START_CAP_S = 20.0
HERE_SRC = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
MODEL = "sim-model"
CHAT = b'{"model":"sim-model","messages":[{"role":"user","content":"Say something short."}]}'
CHAT_STREAM = (b'{"model":"sim-model","stream":true,'
               b'"messages":[{"role":"user","content":"Say something short."}]}')


# ---------------------------------------------------------------------------------------------
# Children


SIM_KNOBS = {"endpoints": 1, "max_seqs": 1024, "ttft_s": 0.0, "tpot_s": 0.0, "max_tokens": 16, "model": MODEL}


class StaticRouter:
    """Every request for MODEL goes to a local provider (a simulator), in turn when there are
    several (benchmarks/streams.py)."""

    def __init__(self, site: str, upstreams: list[str]) -> None:
        from gridd.core.decisions import Forward, UnknownModel
        from gridd.wire import LocalProvider

        self.site = site
        self._forwards = [Forward(site, f"sim{i}", MODEL, local=LocalProvider(f"sim{i}", MODEL, url + "/v1"))
                          for i, url in enumerate(upstreams)]
        self._next = 0
        self._unknown = UnknownModel()

    def decide(self, model, *, pinned_site=None, exclude=frozenset()):
        if model != MODEL:
            return self._unknown
        for _ in range(len(self._forwards)):
            forward = self._forwards[self._next]
            self._next = (self._next + 1) % len(self._forwards)
            if (self.site, forward.provider) not in exclude:
                return forward
        return self._unknown

    def models(self):
        return [MODEL]

    def ready(self):
        return True

    def not_ready_reason(self):
        return None


def run_child(role: str, upstreams: list[str], cpu: int | None, src: str, knobs: str | None,
              bind: str | None = None) -> None:
    if any(name == "gridd" or name.startswith("gridd.") for name in sys.modules):
        raise RuntimeError("gridd was imported before --src was put on the path")
    sys.path.insert(0, src)
    import gridd

    if os.path.dirname(os.path.abspath(gridd.__file__)) != os.path.join(src, "gridd"):
        raise RuntimeError(f"gridd imported from {gridd.__file__}, not from --src {src}")
    from prometheus_client import CollectorRegistry

    from gridd.gateway.front import make_front_app
    from gridd.sim import model as sim_model
    from gridd.sim.app import SimApp

    try:
        from gridd.gateway.upstream_client import make_upstream_client as make_upstream_transport
        from gridd.http.serve import serve_asgi
    except ImportError:  # --src of a checkout from before the forwarding client (issue 13)
        try:
            from gridd.gateway.upstream_transport import make_upstream_transport

            from gridd.http.serve import serve_asgi
        except ImportError:  # --src of a checkout from before the modules were split (issue 17)
            from gridd.gateway.forward import make_upstream_transport
            from gridd.httpserver import serve_asgi

    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    async def main():
        async with trio.open_nursery() as nursery:
            if role == "sim":
                app = SimApp(sim_model.knobs_from(json.loads(knobs) if knobs else SIM_KNOBS))
                urls = await nursery.start(functools.partial(serve_asgi, max_connections=8192), app,
                                           ["127.0.0.1:0"])
                print(urls[0], flush=True)
                return
            async with make_upstream_transport() as transport:
                app = make_front_app(StaticRouter("bench", upstreams), transport, CollectorRegistry(),
                                     rng=random.Random(0))
                # --bind: a replica sharing the first one's port (SO_REUSEPORT, --replicas).
                # The connection cap is raised as in the simulators: streams.py measures
                # throughput at 1000+ clients reconnecting, not the cap (docs/security.md).
                serve = functools.partial(serve_asgi, max_connections=8192)
                if bind:
                    serve = functools.partial(serve, reuse_port=True)
                urls = await nursery.start(serve, app, [bind or "127.0.0.1:0"])
                print(urls[0], flush=True)
                await trio.sleep_forever()

    trio.run(main)


def start_child(role: str, cpu: int | None, src: str, upstreams: tuple[str, ...] = (),
                knobs: dict | None = None, bind: str | None = None) -> tuple[subprocess.Popen, str]:
    args = [sys.executable, os.path.abspath(__file__), "--serve", role, "--src", src]
    if bind:
        args += ["--bind", bind]
    for upstream in upstreams:
        args += ["--upstream", upstream]
    if knobs is not None:
        args += ["--knobs", json.dumps(knobs)]
    if cpu is not None:
        args += ["--cpu", str(cpu)]
    from gridd.childprocs import stop_processes

    child = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    ready, _, _ = select.select([child.stdout], [], [], CHILD_START_CAP_S)
    if not ready:
        stop_processes([child], grace_s=5)
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
        Phase("stream_c1", post(CHAT_STREAM), 1, n(1000)),
        Phase("chat_c16", post(CHAT), 16, n(63)),
        Phase("stream_c16", post(CHAT_STREAM), 16, n(63)),
        Phase("chat_c64", post(CHAT), 64, n(16)),
        Phase("stream_c64", post(CHAT_STREAM), 64, n(16)),
    ]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def hostport(url: str) -> tuple[str, int]:
    host, _, port = url.removeprefix("http://").rpartition(":")
    return host, int(port)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--serve", choices=("sim", "front"))
    parser.add_argument("--upstream", action="append", default=[])
    parser.add_argument("--knobs", help="simulator knobs as JSON (a child's)")
    parser.add_argument("--bind", help="a front replica's address (a child's)")
    parser.add_argument("--replicas", type=int, default=1,
                        help="front processes sharing one port with SO_REUSEPORT (one per CPU, in turn)")
    parser.add_argument("--cpu", type=int)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply request counts")
    parser.add_argument("--src", default=HERE_SRC,
                        help="the checkout the children import gridd from (default: this one)")
    args = parser.parse_args()
    args.src = os.path.abspath(args.src)
    if args.serve:
        run_child(args.serve, args.upstream, args.cpu, args.src, args.knobs, args.bind)
        return
    from gridd.childprocs import stop_processes

    cpus = sorted(os.sched_getaffinity(0))
    load_cpu = cpus[0] if len(cpus) >= 2 else None
    sim_cpu = cpus[1] if len(cpus) >= 2 else None
    if load_cpu is not None:
        os.sched_setaffinity(0, {load_cpu})
    plan = phases(args.scale)
    paths = ("direct", "gateway")
    results: dict[str, dict[str, list[PhaseResult]]] = {p: {ph.key: [] for ph in plan} for p in paths}
    front_cpu: dict[str, list[float]] = {ph.key: [] for ph in plan}  # front CPU ms per request
    # The simulator is the fixture, not the subject: always this checkout's, so an old front
    # (--src) is measured against the same backend as the current one.
    sim, sim_url = start_child("sim", sim_cpu, HERE_SRC)
    try:
        replicas = []
        front, front_url = start_child("front", load_cpu, args.src, upstreams=(sim_url,),
                                       bind="127.0.0.1:0" if args.replicas > 1 else None)
        try:
            for i in range(1, args.replicas):
                replicas.append(start_child("front", cpus[i % len(cpus)], args.src, upstreams=(sim_url,),
                                            bind=front_url.removeprefix("http://"))[0])
            targets = {"direct": hostport(sim_url), "gateway": hostport(front_url)}

            async def drive():
                for path in paths:  # warm-up: pools, caches, the front's upstream connections
                    await run_phase(*targets[path], post(CHAT), 8, max(10, int(100 * args.scale)))
                for round_no in range(args.rounds):
                    order = paths if round_no % 2 == 0 else tuple(reversed(paths))
                    for phase in plan:
                        for path in order:
                            cpu_before = sum(cpu_seconds(p.pid) for p in (front, *replicas))
                            run = await run_phase(*targets[path], phase.request, phase.concurrency,
                                                  phase.per_conn)
                            results[path][phase.key].append(run)
                            if path == "gateway":
                                used = sum(cpu_seconds(p.pid) for p in (front, *replicas)) - cpu_before
                                front_cpu[phase.key].append(1000.0 * used / max(1, len(run.total_s)))
                    print(f"round {round_no + 1}/{args.rounds} done", file=sys.stderr, flush=True)

            trio.run(drive)
        finally:
            stop_processes([front, *replicas], grace_s=5)
    finally:
        stop_processes([sim], grace_s=5)

    def pooled(path: str, key: str, attr: str) -> list[float]:
        return [v for run in results[path][key] for v in getattr(run, attr)]

    def rate(path: str, key: str) -> float:
        return statistics.median(len(r.total_s) / r.wall_s for r in results[path][key])

    capped = sorted({key for path in paths for key, runs in results[path].items()
                     if any(r.capped for r in runs)})
    print(f"# {len(cpus)} CPUs; simulator on CPU {sim_cpu}, front and load generator on CPU {load_cpu}"
          + (f" ({args.replicas} front replicas sharing the port, one per CPU in turn)"
             if args.replicas > 1 else "")
          + "; "
          f"{args.rounds} rounds, scale {args.scale}; python {sys.version.split()[0]}"
          + (f"; CAPPED: {', '.join(capped)}" if capped else ""))
    print("| mode | concurrency | direct req/s | gateway req/s | gateway/direct | added p50 ms "
          "| gateway p50 ms | gateway p99 ms | p99/p50 | front CPU ms/req | load generator CPU ms/req |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for phase in plan:
        key = phase.key
        d50, g50 = pct(pooled("direct", key, "total_s"), 0.5), pct(pooled("gateway", key, "total_s"), 0.5)
        g99 = pct(pooled("gateway", key, "total_s"), 0.99)
        d_rate, g_rate = rate("direct", key), rate("gateway", key)
        mode = "streamed" if key.startswith("stream") else "non-streamed"
        # The load generator shares the front's CPU: what it spends is not the front's to use.
        load_ms = statistics.median(1000.0 * r.client_cpu_s / max(1, len(r.total_s))
                                    for r in results["gateway"][key])
        print(f"| {mode} | {phase.concurrency} | {d_rate:.0f} | {g_rate:.0f} | {g_rate / d_rate:.2f} "
              f"| {g50 - d50:+.3f} | {g50:.3f} | {g99:.3f} | {g99 / g50:.1f} "
              f"| {statistics.median(front_cpu[key]):.3f} "
              f"| {load_ms:.3f} |")
    first_d = pct(pooled("direct", "stream_c1", "first_s"), 0.5)
    first_g = pct(pooled("gateway", "stream_c1", "first_s"), 0.5)
    print(f"# streamed, concurrency 1: first chunk p50 direct {first_d:.3f} ms, gateway {first_g:.3f} ms")
    print(f"rps_c64={rate('gateway', 'chat_c64'):.0f}")
    added = (pct(pooled("gateway", "chat_c1", "total_s"), 0.5)
             - pct(pooled("direct", "chat_c1", "total_s"), 0.5))
    print(f"added_p50_ms={added:.3f}")


if __name__ == "__main__":
    main()
