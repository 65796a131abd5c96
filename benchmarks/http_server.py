"""Benchmark gridd's two ASGI serving backends: hypercorn's trio worker vs the h11 server.

    .venv/bin/python benchmarks/http_server.py [--rounds 3] [--scale 1.0] [--src DIR]

The same tiny ASGI app is served by each backend in a child process (this script with --serve);
the parent drives load over loopback with raw keep-alive sockets (a minimal HTTP/1.1 client, so
the load generator costs as little as possible). With 2 or more cores the child is pinned to
CPU 1 and the parent to CPU 0; load generator and server still share one machine.

Figures are per round, then the median over rounds. Every phase is bounded by a request count
and a time cap (PHASE_CAP_S); a phase that hits the cap is flagged "capped" in the table. Rounds
alternate the backends to spread drift evenly. "server CPU us/req" is the child's utime + stime
(from /proc) around the phase per request: the figure to compare on a shared machine.
``--src DIR`` imports gridd from another checkout in the children (an older commit's server,
measured by the same script).
Last line: h11_vs_hypercorn_rps_ratio=<small GET req/s at concurrency 8, h11 / hypercorn>.
"""

from __future__ import annotations

import argparse
import os
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

from gridd.childprocs import stop_processes

BACKENDS = ("h11", "hypercorn")
CHILD_START_CAP_S = 20.0
SSE_CHUNKS = 50
SSE_CHUNK = b"data: " + b"x" * 92 + b"\n\n"  # 100 bytes
SMALL_BODY = b"hello, world\n"
POST_BODY = b'{"model":"m","messages":[{"role":"user","content":"' + b"y" * 960 + b'"}]}'


# ---------------------------------------------------------------------------------------------
# Server side (child process)


async def bench_app(scope, receive, send):
    if scope["type"] != "http":
        return
    path = scope["path"]
    body = b""
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return
        body += message.get("body", b"")
        if not message.get("more_body", False):
            break
    if path == "/sse":
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")],
            }
        )
        # Like an SSE proxy: a task watches for the client leaving while chunks are sent.
        async with trio.open_nursery() as nursery:

            async def watch_disconnect():
                while (await receive())["type"] != "http.disconnect":
                    pass
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch_disconnect)
            for _ in range(SSE_CHUNKS):
                await send({"type": "http.response.body", "body": SSE_CHUNK, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            nursery.cancel_scope.cancel()
        return
    payload = SMALL_BODY if path == "/small" else b'{"received":%d}' % len(body)
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"text/plain" if path == "/small" else b"application/json"),
                (b"content-length", str(len(payload)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


def run_child(backend: str, cpu: int | None, src: str) -> None:
    sys.path.insert(0, src)
    from gridd.http.serve import serve_asgi

    if not os.path.samefile(os.path.dirname(sys.modules["gridd"].__file__ or ""), os.path.join(src, "gridd")):
        raise RuntimeError(f"the server would not run the gridd of {src}")

    if cpu is not None:
        os.sched_setaffinity(0, {cpu})

    async def main():
        async with trio.open_nursery() as nursery:
            urls = await nursery.start(
                lambda task_status: serve_asgi(
                    bench_app, ["127.0.0.1:0"], server=backend, task_status=task_status
                )
            )
            print(urls[0], flush=True)

    trio.run(main)


# ---------------------------------------------------------------------------------------------
# Load side (parent process)










def request_bytes(method: str, path: str, body: bytes = b"") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: bench\r\nUser-Agent: gridd-bench\r\n"
    if body:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body




def phases(scale: float) -> list[Phase]:
    def n(count: int) -> int:
        return max(10, int(count * scale))

    return [
        Phase("get_c1", request_bytes("GET", "/small"), 1, n(3000)),
        Phase("get_c8", request_bytes("GET", "/small"), 8, n(1500)),
        Phase("post1k_c8", request_bytes("POST", "/post", POST_BODY), 8, n(1000)),
        Phase("sse_c1", request_bytes("GET", "/sse"), 1, n(300)),
        Phase("sse_c8", request_bytes("GET", "/sse"), 8, n(100)),
    ]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_child(backend: str, cpu: int | None, src: str) -> tuple[subprocess.Popen, str, int]:
    args = [sys.executable, os.path.abspath(__file__), "--serve", backend, "--src", src]
    if cpu is not None:
        args += ["--cpu", str(cpu)]
    # PYTHONPATH too: this module imports gridd (childprocs) before run_child can put ``src``
    # first on sys.path, and the gridd package already imported is the one its modules load from.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    child = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=env)
    ready, _, _ = select.select([child.stdout], [], [], CHILD_START_CAP_S)
    if not ready:
        stop_processes([child], grace_s=5)
        raise RuntimeError(f"{backend} server did not start within {CHILD_START_CAP_S}s")
    url = child.stdout.readline().strip()
    hostport = url.removeprefix("http://")
    host, _, port = hostport.rpartition(":")
    return child, host, int(port)






def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--serve", choices=BACKENDS)
    parser.add_argument("--cpu", type=int)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply request counts")
    parser.add_argument("--src", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."),
                        help="the checkout the servers import gridd from (default: this one)")
    args = parser.parse_args()
    args.src = os.path.abspath(args.src)
    if args.serve:
        run_child(args.serve, args.cpu, args.src)
        return

    cpus = sorted(os.sched_getaffinity(0))
    server_cpu = cpus[1] if len(cpus) >= 2 else None
    if server_cpu is not None:
        os.sched_setaffinity(0, {cpus[0]})
    plan = phases(args.scale)
    # results[backend][phase key] -> list of PhaseResult, one per round
    results: dict[str, dict[str, list[PhaseResult]]] = {b: {p.key: [] for p in plan} for b in BACKENDS}
    server_cpu_us: dict[str, dict[str, list[float]]] = {b: {p.key: [] for p in plan} for b in BACKENDS}
    for round_no in range(args.rounds):
        order = BACKENDS if round_no % 2 == 0 else tuple(reversed(BACKENDS))
        for backend in order:
            child, host, port = start_child(backend, server_cpu, args.src)
            try:

                async def drive(host=host, port=port, backend=backend, pid=child.pid):
                    await run_phase(host, port, plan[1].request, 8, max(10, int(200 * args.scale)))  # warm-up
                    for phase in plan:
                        before = cpu_seconds(pid)
                        run = await run_phase(host, port, phase.request, phase.concurrency, phase.per_conn)
                        results[backend][phase.key].append(run)
                        used = cpu_seconds(pid) - before
                        server_cpu_us[backend][phase.key].append(1e6 * used / max(1, len(run.total_s)))

                trio.run(drive)
            finally:
                stop_processes([child], grace_s=5)
            rates = " ".join(
                f"{key}={len(runs[-1].total_s) / runs[-1].wall_s:.0f}/s"
                for key, runs in results[backend].items()
            )
            print(f"round {round_no + 1}/{args.rounds} {backend}: {rates}", file=sys.stderr, flush=True)

    print(
        f"# {len(cpus)} CPUs; server pinned to CPU {server_cpu}, load generator to CPU {cpus[0]}; "
        f"{args.rounds} rounds, scale {args.scale}; python {sys.version.split()[0]}; gridd from {args.src}"
    )
    print("| phase | metric | h11 | hypercorn | h11/hypercorn |")
    print("|---|---|---|---|---|")
    rps = {}
    for phase in plan:
        unit = "streams/s" if phase.key.startswith("sse") else "req/s"
        metrics = [(unit, None, None), ("server CPU us/req", "cpu", None)]
        if phase.key.startswith("sse"):
            metrics += [("TTFB p50 ms", "first_s", 0.5), ("TTFB p99 ms", "first_s", 0.99)]
            metrics += [("total p50 ms", "total_s", 0.5), ("total p99 ms", "total_s", 0.99)]
        else:
            metrics += [("latency p50 ms", "total_s", 0.5), ("latency p99 ms", "total_s", 0.99)]
        label = f"{phase.key} ({phase.concurrency} conn x {phase.per_conn})"
        for name, source, q in metrics:
            cells = []
            values = []
            for backend in BACKENDS:
                runs = results[backend][phase.key]
                # Each figure is computed per round, then the median over rounds is reported, so
                # one round disturbed by the VM's neighbours does not set a tail percentile.
                if source == "cpu":
                    value = statistics.median(server_cpu_us[backend][phase.key])
                    cells.append(f"{value:.0f}")
                elif q is None:
                    value = statistics.median(len(r.total_s) / r.wall_s for r in runs)
                    capped = " (capped)" if any(r.capped for r in runs) else ""
                    cells.append(f"{value:.0f}{capped}")
                else:
                    value = statistics.median(pct(getattr(r, source), q) for r in runs)
                    cells.append(f"{value:.2f}")
                values.append(value)
            print(f"| {label} | {name} | {cells[0]} | {cells[1]} | {values[0] / values[1]:.2f} |")
            if q is None and source is None:
                rps[phase.key] = tuple(values)
    print(f"h11_vs_hypercorn_rps_ratio={rps['get_c8'][0] / rps['get_c8'][1]:.2f}")


if __name__ == "__main__":
    main()
