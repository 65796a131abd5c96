"""Many concurrent streamed chat completions through one gateway front (issue 18).

    .venv/bin/python benchmarks/streams.py [--concurrency 1000] [--hold-s 60] [--src DIR] [--direct]

Processes (loopback only): two simulators (8 endpoints x 128 sequences each; 0.2 s to the
first token, 100 tokens 0.02 s apart, so a stream takes BACKEND_STREAM_S = 2.18 s at the
backend), a gateway front forwarding to them in turn (benchmarks/proxy.py's front child), and
this parent: N clients, each opening a new connection per stream (so accepting is measured
too), reading the stream to its end, and starting the next, until the hold time is over.

Every ``--row-s`` seconds a row: streams finished per second, first chunk p50/p99 (from the
client's connect, so a wait in the listen queue counts), whole stream p50/p99, the front's CPU
(% of one core), RSS, open descriptors, and new upstream connections per upstream request
(from the front's /metrics). Ends with the whole run's figures, the largest first-chunk time,
and ``streams_ratio=<end-to-end stream p50 / BACKEND_STREAM_S>``.

``--direct`` sends the same load straight to the simulators (half to each; the front still
runs, idle): on a small machine the clients and simulators may be the limit, and this shows
where it lies.

Bounded: at most MAX_CONCURRENCY clients and MAX_HOLD_S; each stream is cut after
STREAM_CAP_S (counted as failed); streams still open when the hold time ends are not counted.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import sys
import time

import trio
from proxy import CHAT_STREAM, hostport, post, start_child  # benchmarks/ is sys.path[0]
from rawhttp import CONNECT_CAP_S, pct

from gridd.childprocs import stop_processes

MAX_CONCURRENCY = 5000
MAX_HOLD_S = 600.0
STREAM_CAP_S = 60.0
SIM_KNOBS = {"endpoints": 8, "max_seqs": 128, "ttft_s": 0.2, "tpot_s": 0.02, "max_tokens": 100,
             "model": "sim-model"}
BACKEND_STREAM_S = SIM_KNOBS["ttft_s"] + (SIM_KNOBS["max_tokens"] - 1) * SIM_KNOBS["tpot_s"]
_END = b"0\r\n\r\n"


class Window:
    """Samples since the last row."""

    def __init__(self) -> None:
        self.first_s: list[float] = []
        self.total_s: list[float] = []
        self.failed = 0


async def one_stream(host: str, port: int, request: bytes) -> tuple[float, float]:
    """(seconds from connect to the first body bytes, seconds to the end of the stream)."""
    start = time.perf_counter()
    with trio.fail_after(CONNECT_CAP_S):
        stream = await trio.open_tcp_stream(host, port)
    async with stream:
        await stream.send_all(request)
        first = None
        tail = b""
        while True:
            data = await stream.receive_some(65536)
            if not data:
                raise ConnectionError("closed before the end of the stream")
            if first is None:
                if not data.startswith(b"HTTP/1.1 200 "):
                    raise ConnectionError(f"answer {data[:40]!r}")
                first = time.perf_counter()
            tail = (tail + data)[-len(_END):]
            if tail == _END:
                return first - start, time.perf_counter() - start


def proc_figures(pid: int) -> tuple[float, float, int]:
    """(CPU seconds, RSS MB, open descriptors) of a process, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    rss = int(fields[21]) * os.sysconf("SC_PAGE_SIZE") / 1e6
    return cpu, rss, len(os.listdir(f"/proc/{pid}/fd"))


async def upstream_counts(host: str, port: int) -> tuple[float, float]:
    """(upstream connections opened, upstream requests sent) from the front's /metrics."""
    text = b""  # a scrape that does not finish in time counts nothing
    with trio.move_on_after(CONNECT_CAP_S):
        stream = await trio.open_tcp_stream(host, port)
        async with stream:
            await stream.send_all(b"GET /metrics HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
            while data := await stream.receive_some(65536):
                text += data
    found = {name: sum(float(v) for v in re.findall(rb"^" + name.encode() + rb"\{[^}]*\} (\S+)$", text, re.M))
             for name in ("gridd_gateway_upstream_connections_opened_total",
                          "gridd_gateway_upstream_requests_sent_total")}
    return (found["gridd_gateway_upstream_connections_opened_total"],
            found["gridd_gateway_upstream_requests_sent_total"])


async def drive(front_pid: int, host: str, port: int, targets: list[tuple[str, int]], concurrency: int,
                hold_s: float, row_s: float) -> dict:
    request = post(CHAT_STREAM)
    window = Window()
    every_first: list[float] = []
    every_total: list[float] = []
    failed: dict[str, int] = {}
    deadline = trio.current_time() + hold_s

    async def client(target: tuple[str, int]) -> None:
        while trio.current_time() < deadline:
            try:
                with trio.fail_after(STREAM_CAP_S):
                    first, total = await one_stream(*target, request)
            except (OSError, ConnectionError, trio.TooSlowError, trio.BrokenResourceError) as exc:
                window.failed += 1
                if not failed:
                    print(f"# first failure: {exc!r}", flush=True)
                failed[type(exc).__name__] = failed.get(type(exc).__name__, 0) + 1
                await trio.sleep(0.1)
                continue
            window.first_s.append(first)
            window.total_s.append(total)

    print("| t s | streams/s | first p50 ms | first p99 ms | total p50 s | total p99 s | failed "
          "| front CPU % | RSS MB | fds | new upstream conns/request |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")

    async def rows() -> None:
        nonlocal window
        started = trio.current_time()
        cpu0, _, _ = proc_figures(front_pid)
        opened0, sent0 = await upstream_counts(host, port)
        while True:
            await trio.sleep(row_s)
            cpu, rss, fds = proc_figures(front_pid)
            opened, sent = await upstream_counts(host, port)
            done, window = window, Window()
            every_first.extend(done.first_s)
            every_total.extend(done.total_s)
            reuse = (opened - opened0) / (sent - sent0) if sent > sent0 else float("nan")
            print(f"| {trio.current_time() - started:.0f} | {len(done.total_s) / row_s:.0f} "
                  f"| {pct(done.first_s, 0.5) if done.first_s else float('nan'):.0f} "
                  f"| {pct(done.first_s, 0.99) if done.first_s else float('nan'):.0f} "
                  f"| {pct(done.total_s, 0.5) / 1000 if done.total_s else float('nan'):.2f} "
                  f"| {pct(done.total_s, 0.99) / 1000 if done.total_s else float('nan'):.2f} "
                  f"| {done.failed} | {100 * (cpu - cpu0) / row_s:.0f} | {rss:.0f} | {fds} | {reuse:.3f} |",
                  flush=True)
            cpu0, opened0, sent0 = cpu, opened, sent

    opened_start, sent_start = await upstream_counts(host, port)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(rows)
        async with trio.open_nursery() as clients:
            clients.cancel_scope.deadline = deadline + STREAM_CAP_S
            for i in range(concurrency):
                clients.start_soon(client, targets[i % len(targets)])
        nursery.cancel_scope.cancel()
    every_first.extend(window.first_s)
    every_total.extend(window.total_s)
    opened, sent = await upstream_counts(host, port)
    return {"first": every_first, "total": every_total, "failed": failed,
            "reuse": (opened - opened_start) / max(1.0, sent - sent_start)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", type=int, default=1000)
    parser.add_argument("--hold-s", type=float, default=60.0)
    parser.add_argument("--row-s", type=float, default=10.0)
    parser.add_argument("--direct", action="store_true", help="clients go straight to the simulators")
    parser.add_argument("--src", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."),
                        help="the checkout the children import gridd from (default: this one)")
    args = parser.parse_args()
    if not 1 <= args.concurrency <= MAX_CONCURRENCY or not 0 < args.hold_s <= MAX_HOLD_S:
        parser.error(f"--concurrency 1..{MAX_CONCURRENCY}, --hold-s up to {MAX_HOLD_S}")
    src = os.path.abspath(args.src)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    cpus = sorted(os.sched_getaffinity(0))
    front_cpu = cpus[0] if len(cpus) >= 2 else None
    other_cpu = cpus[1] if len(cpus) >= 2 else None
    if other_cpu is not None:
        os.sched_setaffinity(0, {other_cpu})
    print(f"# {len(cpus)} CPUs: front on CPU {front_cpu}, simulators and clients on CPU {other_cpu}; "
          f"{args.concurrency} clients "
          f"{'straight to the simulators' if args.direct else 'through the front'} for {args.hold_s:.0f} s, "
          f"a new connection per stream; backend stream {BACKEND_STREAM_S:.2f} s; src {src}", flush=True)
    sims = [start_child("sim", other_cpu, src, knobs=SIM_KNOBS) for _ in range(2)]
    try:
        front, front_url = start_child("front", front_cpu, src, upstreams=tuple(url for _, url in sims))
        try:
            targets = [hostport(url) for _, url in sims] if args.direct else [hostport(front_url)]
            result = trio.run(drive, front.pid, *hostport(front_url), targets, args.concurrency, args.hold_s,
                              args.row_s)
        finally:
            stop_processes([front], grace_s=5)
    finally:
        stop_processes([child for child, _ in sims], grace_s=5)
    first, total = result["first"], result["total"]
    if not total:
        print("no stream finished")
        sys.exit(1)
    p50 = pct(total, 0.5) / 1000
    print(f"# streams={len(total)} failed={result['failed']} first_p50_ms={pct(first, 0.5):.0f} "
          f"first_p99_ms={pct(first, 0.99):.0f} first_max_ms={max(first) * 1000:.0f} "
          f"total_p50_s={p50:.2f} total_p99_s={pct(total, 0.99) / 1000:.2f} "
          f"new_upstream_conns_per_request={result['reuse']:.3f}")
    print(f"streams_ratio={p50 / BACKEND_STREAM_S:.2f}")


if __name__ == "__main__":
    main()
