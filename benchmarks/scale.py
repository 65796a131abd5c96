"""Cost curves for providers, sites and gateways (issue 16; docs/scaling.md).

Three curves, each point repeated (--repeats, default 3) and shown as median [min..max]:

- operator: one real OperatorService (gridd.operator.service, the daemon's own code path:
  scrape pool, parse, derive, publish, hold) in a child process, scraping 10 / 100 / 1000
  providers at the 1 s interval with the 16-slot pool. The providers are one other child
  process of this script serving tests/data/samples/epp-healthy.prom (about 75 KB, its
  counters moving on every scrape: CountingBody) on one loopback port per provider, each
  answering after its own fixed 5-50 ms delay. The operator scrapes with the lean client
  (gridd.operator.http1); one more point at 1000 providers goes through the httpx client it
  used before, the same-run baseline ("lean vs httpx, same run"). CPU is the
  operator process's own CPU time (time.process_time, user + system), never wall time, so
  other load on the machine does not count; RSS is VmRSS of that process.
- signals channel (in-process, gridd.wire): one poll answer for 2 / 10 / 50 sites x 10 / 100
  providers each: the peer answer (one site's batches) and the gateway answer (every site's),
  bytes, holdings.relay + encode, and decode.
- gateway (in-process, gridd.core.store.GatewayStore): ingest of one poll answer (admission,
  learning, then the rebuild of every model's snapshot) and the rebuild alone, for 10 / 100 /
  1000 candidates; RSS per candidate from a child process holding them.

The operator's CPU per pass is also split in two: ``publish``, the CPU inside
ProviderPublisher.on_scrape (gridd/core: parse, derive, readiness, batch), and ``rest``, the
shell (scrape pool, HTTP client, trio, the service's result handling). ``--compare TREE``
adds a "base" row, 1000 providers x 16 slots on TREE's gridd (an unchanged checkout),
interleaved with the other points in every repeat; ``--src TREE`` runs every operator point
on TREE's gridd; ``--only-1000`` runs the 1000 x 16 point alone (with the "base" row).

Bounded: every phase has a fixed count of passes, polls or rounds and a wall-clock budget;
network only on 127.0.0.1. Run: nice -n 15 .venv/bin/python benchmarks/scale.py [--repeats N] [--quick]
The last line is machine-readable: scrape_cpu_share_1000=<fraction of one core the operator
uses scraping 1000 providers at 1 s>, i.e. its CPU seconds per pass over the 1 s interval.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgspec  # noqa: E402
import trio  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO / "tests" / "data" / "samples" / "epp-healthy.prom"
WALL0 = 1_800_000_000.0

PROVIDER_COUNTS = (10, 100, 1000)
SITE_COUNTS = (2, 10, 50)
SITE_PROVIDERS = (10, 100)
CANDIDATE_COUNTS = (10, 100, 1000)
MODELS = 10  # gateway candidates are spread over this many models
WARMUP_PASSES = 2
OPERATOR_BUDGET_S = 60.0  # per operator run, however slow the machine is
OPERATOR_SRC: Path | None = None  # --src: the gridd tree the operator child imports
COMPARE_SRC: Path | None = None  # --compare: the tree of the "base" point (1000 x 16, lean client)


def latency_ms(index: int) -> int:
    """Provider ``index``'s fixed answer delay: 5..50 ms, spread evenly (mean about 27.5)."""
    return 5 + (index * 17) % 46


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def spread(values: list[float], fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}..{fmt.format(max(values))}]"


# --- providers: a static-exposition server ---------------------------------------------------


class CountingBody:
    """The sample body as a live provider serves it: every counter moves between scrapes.
    Each counter sample (``*_total``, ``*_count``, a histogram's ``le="+Inf"`` bucket) grows by
    one request per scrape and each ``*_sum`` by 50 ms, so the operator never parses the same
    body twice (histograms stay consistent: count = +Inf bucket, buckets cumulative)."""

    def __init__(self, body: bytes) -> None:
        # Alternating static text and (line up to its value, base value, step) parts.
        self.parts: list[bytes | tuple[bytes, float, float]] = []
        static: list[bytes] = []
        for line in body.split(b"\n"):
            head, _, value = line.rpartition(b" ")
            name = head.split(b"{", 1)[0]
            counter = name.endswith((b"_total", b"_count")) or b'le="+Inf"' in head
            if head and not line.startswith(b"#") and (counter or name.endswith(b"_sum")):
                self.parts.append(b"\n".join(static) + (b"\n" if static else b""))
                static = []
                self.parts.append((head + b" ", float(value), 1.0 if counter else 0.05))
                static.append(b"")
            else:
                static.append(line)
        self.parts.append(b"\n".join(static))

    def render(self, scrape: int) -> bytes:
        return b"".join(
            part if isinstance(part, bytes) else part[0] + b"%.10g" % (part[1] + part[2] * scrape)
            for part in self.parts
        )


async def serve_providers(count: int) -> None:
    """``count`` listeners on 127.0.0.1, one per provider; each answers any GET with the
    sample body (its counters moved on by one scrape, CountingBody) after its provider's
    delay, keep-alive. Prints the ports as one JSON line and serves until stdin closes (the
    parent exits or closes it)."""
    body = CountingBody(SAMPLE.read_bytes())
    scrapes = [0] * count

    async def answer(stream: trio.SocketStream, index: int, delay_s: float) -> None:
        buffered = b""
        try:
            while True:
                while b"\r\n\r\n" not in buffered:
                    chunk = await stream.receive_some(65536)
                    if not chunk:
                        return
                    buffered += chunk
                buffered = buffered.split(b"\r\n\r\n", 1)[1]  # GETs carry no body
                await trio.sleep(delay_s)
                scrapes[index] += 1
                payload = body.render(scrapes[index])
                await stream.send_all(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\n"
                    b"content-length: %d\r\n\r\n" % len(payload) + payload
                )
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return
        finally:
            await trio.aclose_forcefully(stream)

    async with trio.open_nursery() as nursery:
        ports = []
        for index in range(count):
            listeners = await trio.open_tcp_listeners(0, host="127.0.0.1", backlog=64)
            ports.append(listeners[0].socket.getsockname()[1])
            delay_s = latency_ms(index) / 1000

            async def handler(
                stream: trio.SocketStream, index: int = index, delay_s: float = delay_s
            ) -> None:
                await answer(stream, index, delay_s)

            nursery.start_soon(trio.serve_listeners, handler, listeners)
        print(json.dumps(ports), flush=True)
        await trio.to_thread.run_sync(sys.stdin.read)  # EOF: the parent is done
        nursery.cancel_scope.cancel()


def start_providers(count: int) -> tuple[subprocess.Popen, list[int]]:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve-providers", str(count)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise SystemExit("the provider server did not start")
    return proc, json.loads(line)


def stop(proc: subprocess.Popen) -> None:
    if proc.stdin is not None:
        proc.stdin.close()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# --- operator: one OperatorService in a child process ----------------------------------------


def operator_config(ports: list[int], concurrency: int, state_dir: Path) -> str:
    lines = [
        "role: operator",
        "site: a",
        f"state_dir: {state_dir}",
        f"timings: {{scrape_interval_s: 1, scrape_concurrency: {concurrency}}}",
        "providers:",
    ]
    for i, port in enumerate(ports):
        base = f"http://127.0.0.1:{port}"
        lines += [
            f"  - name: p{i}",
            f"    model: m{i % MODELS}",
            f'    settings: {{endpoint: "{base}/v1"}}',
            f'    metrics: {{url: "{base}/metrics", timeout_s: 2, kind: epp}}',
        ]
    return "\n".join(lines) + "\n"


async def run_operator(config_path: Path, passes: int, client_kind: str) -> dict:
    from prometheus_client import CollectorRegistry

    from gridd.config import load_config
    from gridd.operator.http1 import ScrapeClient
    from gridd.operator.scrape import Client, make_client, make_scrape_client
    from gridd.operator.service import OperatorService

    loaded = load_config(config_path, env={})
    # "lean": the scrape path's own keep-alive client (gridd.operator.http1), the daemon's
    # default; "httpx": the httpx client it used before (make_client), the same-run baseline.
    client: Client = (make_scrape_client() if client_kind == "lean"
                      else make_client(loaded.config.timings.scrape_concurrency))
    # (process CPU, wall, pass duration, RSS MB, system CPU, CPU inside the publishers)
    marks: list[tuple[float, ...]] = []
    done = trio.Event()
    # CPU spent in ProviderPublisher.on_scrape (gridd/core: parse, derive, readiness, batch),
    # so a pass's CPU splits into that and the rest (the shell: scrape pool, HTTP client,
    # trio, the service's result handling). Timing costs two clock reads per scrape.
    publishing = [0.0]

    def timed(on_scrape: Callable[..., Any]) -> Callable[..., Any]:
        def on_scrape_timed(**kwargs: Any) -> Any:
            start = time.process_time()
            try:
                return on_scrape(**kwargs)
            finally:
                publishing[0] += time.process_time() - start

        return on_scrape_timed

    def on_pass(started: float, duration: float) -> None:
        times = os.times()
        marks.append((time.process_time(), time.monotonic(), duration, rss_mb(), times.system, publishing[0]))
        if len(marks) > WARMUP_PASSES + passes:
            done.set()

    operator = OperatorService(loaded, CollectorRegistry(), client=client, pass_observer=on_pass)
    rss_before = rss_mb()
    async with trio.open_nursery() as nursery:
        await nursery.start(operator.run)
        for publisher in operator.publishers.values():  # from the first (warm-up) pass on
            publisher.on_scrape = timed(publisher.on_scrape)  # type: ignore[method-assign]  # benchmark split
        with trio.move_on_after(OPERATOR_BUDGET_S):
            await done.wait()
        nursery.cancel_scope.cancel()
    measured = marks[WARMUP_PASSES:]
    cpu = [b[0] - a[0] for a, b in zip(measured, measured[1:], strict=False)]
    publish = [b[5] - a[5] for a, b in zip(measured, measured[1:], strict=False)]
    failing = sum(1 for p in operator.publishers.values() if p.summary.last_failure_class is not None)
    return {
        "cpu_per_pass_s": statistics.median(cpu) if cpu else float("nan"),
        "publish_cpu_per_pass_s": statistics.median(publish) if publish else float("nan"),
        "rest_cpu_per_pass_s": statistics.median(c - p for c, p in zip(cpu, publish, strict=True))
        if cpu
        else float("nan"),
        "pass_s": statistics.median(m[2] for m in measured[1:]) if len(measured) > 1 else float("nan"),
        "share": (measured[-1][0] - measured[0][0]) / (measured[-1][1] - measured[0][1])
        if len(measured) > 1
        else float("nan"),
        "rss_mb": measured[-1][3] if measured else float("nan"),
        # The kernel's share of the CPU (connect, close, socket reads): on loopback it also
        # carries the provider side's TCP work done in this process's context.
        "system_share": (
            (measured[-1][4] - measured[0][4]) / (measured[-1][0] - measured[0][0])
            if len(measured) > 1
            else float("nan")
        ),
        "rss_before_mb": rss_before,
        "passes": len(measured) - 1,
        "failing": failing,
        "max_in_flight": operator.pool.max_in_flight_seen if operator.pool else 0,
        "connections_opened": client.connections_opened if isinstance(client, ScrapeClient) else None,
    }


def operator_point(ports: list[int], concurrency: int, passes: int, client_kind: str) -> dict:
    """One operator child. ``client_kind``: "lean" or "httpx" (the client it scrapes with), or
    "base": the lean client, running the gridd of the --compare tree."""
    src = COMPARE_SRC if client_kind == "base" else OPERATOR_SRC
    client = "lean" if client_kind == "base" else client_kind
    with tempfile.TemporaryDirectory(prefix="gridd-scale-") as tmp:
        config = Path(tmp) / "operator.yaml"
        config.write_text(operator_config(ports, concurrency, Path(tmp) / "state"))
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--operator-child",
                str(config),
                "--passes",
                str(passes),
                "--client",
                client,
                *(["--src", str(src)] if src is not None else []),
            ],
            capture_output=True,
            text=True,
            timeout=OPERATOR_BUDGET_S + 30,
        )
        if out.returncode != 0:
            raise SystemExit(f"operator child failed:\n{out.stderr[-2000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])


def operator_curve(
    counts: tuple[int, ...], repeats: int, passes: int, extra: list[tuple[int, int, str]]
) -> dict:
    print(
        "== operator: one OperatorService scraping N providers at 1 s (epp-healthy.prom, counters moving, "
        "5-50 ms) =="
    )
    print(
        f"{'providers':>9} {'slots':>5} {'client':>6} {'cpu_s/pass':>24} {'publish':>7} {'rest':>7} "
        f"{'pass_s':>24} {'cpu share':>24} {'rss_mb':>7} {'sys':>5} {'failing':>7}"
    )
    results: dict[tuple[int, int, str], list[dict]] = {}
    points = [(n, 16, "lean") for n in counts] + extra
    server, ports = start_providers(max(n for n, _, _ in points))
    try:
        for _ in range(repeats):  # interleaved, so a burst of outside load hits every point alike
            for n, slots, client_kind in points:
                results.setdefault((n, slots, client_kind), []).append(
                    operator_point(ports[:n], slots, passes, client_kind)
                )
    finally:
        stop(server)
    for (n, slots, client_kind), runs in results.items():
        print(
            f"{n:>9} {slots:>5} {client_kind:>6} {spread([r['cpu_per_pass_s'] for r in runs]):>24} "
            f"{statistics.median(r['publish_cpu_per_pass_s'] for r in runs):7.3f} "
            f"{statistics.median(r['rest_cpu_per_pass_s'] for r in runs):7.3f} "
            f"{spread([r['pass_s'] for r in runs]):>24} {spread([r['share'] for r in runs]):>24} "
            f"{statistics.median(r['rss_mb'] for r in runs):7.1f} "
            f"{statistics.median(r['system_share'] for r in runs):5.2f} {max(r['failing'] for r in runs):>7}"
        )
    small, large = results[(counts[0], 16, "lean")], results[(counts[-1], 16, "lean")]
    per_provider_kb = (
        (statistics.median(r["rss_mb"] for r in large) - statistics.median(r["rss_mb"] for r in small))
        * 1024
        / (counts[-1] - counts[0])
        if counts[-1] > counts[0]
        else float("nan")
    )
    if counts[-1] > counts[0]:
        print(f"rss per provider: {per_provider_kb:.1f} KiB ({counts[0]} -> {counts[-1]} providers)")
    points_out = {
        f"{n}x{s}" + ("" if kind == "lean" else f"-{kind}"): runs for (n, s, kind), runs in results.items()
    }
    return {"points": points_out, "rss_per_provider_kib": per_provider_kb}


# --- realistic batches ------------------------------------------------------------------------


def sample_batch():
    """One complete batch published from the healthy EPP sample (the operator's own path)."""
    from gridd.core.publication import ProviderPublisher

    body = SAMPLE.read_bytes()
    seq = iter(range(1, 1_000_000))
    publisher = ProviderPublisher(
        site="s0",
        provider="p0",
        model="m0",
        provider_uid="uid-p0",
        generation=1,
        publisher_epoch=int(WALL0),
        created_at=0.0,
        next_sequence=lambda: next(seq),
    )
    batch = None
    for t in (1.0, 2.0, 3.0):
        batch = publisher.on_scrape(
            now=t, wall_now=WALL0 + t, body=body, failure_class=None, stale_after_s=10.0, unavailable=False
        )
    assert batch is not None and batch.complete, "the healthy sample must publish a complete batch"
    return batch


def batches_for(template, sites: int, providers: int, sequence: int, published_ms: int):
    from gridd.core.readings import Revision  # noqa: F401  (the template's revision type)

    out = []
    for s in range(sites):
        for p in range(providers):
            revision = msgspec.structs.replace(
                template.revision, provider_uid=f"uid-s{s}-p{p}", batch_sequence=sequence
            )
            out.append(
                msgspec.structs.replace(
                    template,
                    site=f"s{s}",
                    provider=f"p{p}",
                    model=f"m{p % MODELS}",
                    revision=revision,
                    published_ms=published_ms,
                )
            )
    return out


def best_of(fn, rounds: int) -> list[float]:
    """Per-call seconds of ``fn`` in ``rounds`` timed calls, process CPU time."""
    times = []
    for _ in range(rounds):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return times


# --- signals channel ---------------------------------------------------------------------------


def signals_curve(rounds: int) -> list[dict]:
    from gridd.core.holdings import Holdings
    from gridd.wire import PROTOCOL_VERSION, Batches, decode, encode

    print(
        "\n== signals channel: one poll answer (in-process gridd.wire; process CPU ms, median [min..max]) =="
    )
    print(
        f"{'sites':>5} {'prov/site':>9} {'answer':>7} {'batches':>7} {'bytes':>9} {'B/batch':>7} "
        f"{'relay+encode ms':>22} {'decode ms':>22}"
    )
    template = sample_batch()
    rows = []
    for providers in SITE_PROVIDERS:
        for sites in SITE_COUNTS:
            holdings = Holdings()
            for batch in batches_for(template, sites, providers, 1, int(WALL0 * 1000)):
                holdings.hold(batch, 0.0)
            for answer, site in (("peer", "s0"), ("gateway", None)):

                def relay_encode(site=site, holdings=holdings):
                    return encode(
                        Batches(
                            protocol=PROTOCOL_VERSION, sent_wall=WALL0, batches=holdings.relay(1.0, site=site)
                        )
                    )

                frame = relay_encode()
                enc = best_of(relay_encode, rounds)
                dec = best_of(lambda frame=frame: decode(frame), rounds)
                count = providers if site else sites * providers
                row = {
                    "sites": sites,
                    "providers": providers,
                    "answer": answer,
                    "batches": count,
                    "bytes": len(frame),
                    "encode_ms": [t * 1e3 for t in enc],
                    "decode_ms": [t * 1e3 for t in dec],
                }
                rows.append(row)
                print(
                    f"{sites:>5} {providers:>9} {answer:>7} {count:>7} {len(frame):>9} "
                    f"{len(frame) // count:>7} {spread(row['encode_ms']):>22} {spread(row['decode_ms']):>22}"
                )
    return rows


# --- one gateway poll, end to end: cursors or none -----------------------------------------------


def poll_cycle_curve(rounds: int) -> list[dict]:
    """One steady-state gateway poll of its operator (1 s gateway poll, 5 s peer poll): since
    the previous poll every own-site batch changed (1 s scrape) and a fifth of every other
    site's (each peer is polled every 5 s). Operator side: decode the Poll, relay, apply the
    cursors, encode. Gateway side: build the cursors and encode the Poll; decode the answer,
    ingest it (with the rebuild). Process CPU ms per poll; bytes each way."""
    from gridd.core.cursors import held_cursors, unchanged_batches
    from gridd.core.holdings import Holdings
    from gridd.wire import PROTOCOL_VERSION, Batches, Poll, decode, encode

    print("\n== one gateway poll at steady state (own site changed, 1/5 of the rest): cursors or none ==")
    print(
        f"{'sites':>5} {'prov/site':>9} {'cursors':>7} {'poll B':>8} {'answer B':>9} {'sent':>5} "
        f"{'operator ms':>22} {'gateway ms':>22}"
    )
    template = sample_batch()
    providers = 100
    rows = []
    for sites in (10, 50, 100):
        for with_cursors in (False, True):
            holdings, seq = Holdings(), 1
            for batch in batches_for(template, sites, providers, seq, int(WALL0 * 1000)):
                holdings.hold(batch, 0.0)
            store, _, _ = gateway_store(sites * providers)
            store.ingest(holdings.relay(0.0), now=0.0, now_wall=WALL0)
            op_ms, gw_ms = [], []
            for r in range(1, rounds + 1):
                now = float(r)
                seq += 1
                # Changed since the last poll: all of s0, and the remote sites whose index
                # falls on this second of the 5 s peer-poll cycle.
                changed = [
                    b
                    for b in batches_for(template, sites, providers, seq, int((WALL0 + now) * 1000))
                    if b.site == "s0" or int(b.site[1:]) % 5 == r % 5
                ]
                for batch in changed:
                    holdings.hold(batch, now)
                gw_start = time.process_time()
                cursors = held_cursors(store.candidates, store.fences) if with_cursors else ()
                poll_frame = encode(Poll(protocol=PROTOCOL_VERSION, sent_wall=WALL0 + now, cursors=cursors))
                gw_ms.append(time.process_time() - gw_start)
                op_start = time.process_time()
                poll = decode(poll_frame)
                batches, unchanged = holdings.relay_since(now, poll.cursors)
                frame = encode(
                    Batches(
                        protocol=PROTOCOL_VERSION, sent_wall=WALL0 + now, batches=batches, unchanged=unchanged
                    )
                )
                op_ms.append((time.process_time() - op_start) * 1e3)
                gw_start = time.process_time()
                answer = decode(frame)
                store.ingest(
                    [*answer.batches, *unchanged_batches(store.candidates, answer.unchanged)],
                    now=now,
                    now_wall=WALL0 + now,
                )
                gw_ms[-1] = (gw_ms[-1] + time.process_time() - gw_start) * 1e3
            row = {
                "sites": sites,
                "providers": providers,
                "cursors": with_cursors,
                "poll_bytes": len(poll_frame),
                "answer_bytes": len(frame),
                "sent": len(answer.batches),
                "operator_ms": op_ms,
                "gateway_ms": gw_ms,
            }
            rows.append(row)
            print(
                f"{sites:>5} {providers:>9} {'yes' if with_cursors else 'no':>7} {len(poll_frame):>8} "
                f"{len(frame):>9} {len(answer.batches):>5} {spread(op_ms):>22} {spread(gw_ms):>22}"
            )
    return rows


# --- gateway ------------------------------------------------------------------------------------


def gateway_store(candidates: int):
    from gridd.core.store import GatewayStore
    from gridd.wire import LocalProvider, ServingConfig, SiteIngress

    sites = max(1, candidates // 100) if candidates >= 100 else 1
    per_site = candidates // sites
    store = GatewayStore(site="s0")
    store.set_serving(
        ServingConfig(
            providers=tuple(
                LocalProvider(provider=f"p{p}", model=f"m{p % MODELS}", endpoint_url="http://x/v1")
                for p in range(per_site)
            ),
            ingresses=tuple(SiteIngress(site=f"s{s}", url=f"http://ingress-{s}") for s in range(1, sites)),
        )
    )
    return store, sites, per_site


def gateway_curve(rounds: int) -> list[dict]:
    print("\n== gateway: GatewayStore per poll (in-process; process CPU ms, median [min..max]) ==")
    print(
        f"{'candidates':>10} {'models':>6} {'ingest+rebuild ms':>24} {'rebuild ms':>22} {'rss KiB/cand':>12}"
    )
    template = sample_batch()
    rows = []
    for candidates in CANDIDATE_COUNTS:
        store, sites, per_site = gateway_store(candidates)
        polls = [
            batches_for(template, sites, per_site, seq, int((WALL0 + seq) * 1000))
            for seq in range(1, rounds + 2)
        ]
        store.ingest(polls[0], now=1.0, now_wall=WALL0 + 1)
        ingest = []
        for seq, poll in enumerate(polls[1:], start=2):
            start = time.process_time()
            store.ingest(poll, now=float(seq), now_wall=WALL0 + seq)
            ingest.append((time.process_time() - start) * 1e3)
        rebuild = [t * 1e3 for t in best_of(lambda store=store: store.rebuild(float(rounds + 2)), rounds)]
        rss = gateway_rss(candidates)
        row = {
            "candidates": candidates,
            "models": min(MODELS, per_site),
            "ingest_ms": ingest,
            "rebuild_ms": rebuild,
            "rss_kib_per_candidate": rss,
        }
        rows.append(row)
        print(f"{candidates:>10} {row['models']:>6} {spread(ingest):>24} {spread(rebuild):>22} {rss:>12.1f}")
    return rows


def gateway_rss(candidates: int) -> float:
    out = subprocess.run(
        [sys.executable, __file__, "--gateway-child", str(candidates)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if out.returncode != 0:
        raise SystemExit(f"gateway child failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["kib_per_candidate"]


def gateway_child(candidates: int) -> None:
    """RSS growth of a store from empty to ``candidates`` held (after three polls, so the
    learners hold history), per candidate. The poll answers are freed before measuring."""
    template = sample_batch()
    store, sites, per_site = gateway_store(candidates)
    gc.collect()
    before = rss_mb()
    for seq in (1, 2, 3):
        poll = batches_for(template, sites, per_site, seq, int((WALL0 + seq) * 1000))
        store.ingest(poll, now=float(seq), now_wall=WALL0 + seq)
        del poll
    gc.collect()
    print(json.dumps({"kib_per_candidate": (rss_mb() - before) * 1024 / candidates}))


# --- plot -------------------------------------------------------------------------------------


def plot(operator: dict, signals: list[dict], gateway: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_op, ax_sig, ax_gw) = plt.subplots(1, 3, figsize=(15, 4.2))
    counts = list(PROVIDER_COUNTS)
    runs = [operator["points"][f"{n}x16"] for n in counts]
    for key, label in (("cpu_per_pass_s", "CPU s per pass"), ("pass_s", "pass duration s")):
        med = [statistics.median(r[key] for r in rs) for rs in runs]
        low = [med[i] - min(r[key] for r in rs) for i, rs in enumerate(runs)]
        high = [max(r[key] for r in rs) - med[i] for i, rs in enumerate(runs)]
        ax_op.errorbar(counts, med, yerr=[low, high], marker="o", capsize=3, label=label)
    baseline = operator["points"].get(f"{counts[-1]}x16-httpx")
    if baseline:
        ax_op.plot(
            [counts[-1]],
            [statistics.median(r["cpu_per_pass_s"] for r in baseline)],
            marker="x",
            linestyle="none",
            color="black",
            label="CPU s per pass, httpx client (same run)",
        )
    ax_op.axhline(1.0, color="grey", linestyle=":", label="1 s interval / one core")
    ax_op.set(xscale="log", yscale="log", xlabel="providers (16-slot pool, 1 s)", title="operator")
    ax_op.legend(fontsize=8)
    for providers in SITE_PROVIDERS:
        rows = [r for r in signals if r["providers"] == providers and r["answer"] == "gateway"]
        ax_sig.plot(
            [r["batches"] for r in rows],
            [statistics.median(r["encode_ms"]) for r in rows],
            marker="o",
            label=f"relay+encode, {providers}/site",
        )
        ax_sig.plot(
            [r["batches"] for r in rows],
            [statistics.median(r["decode_ms"]) for r in rows],
            marker="s",
            linestyle="--",
            label=f"decode, {providers}/site",
        )
    ax_sig.set(
        xscale="log",
        yscale="log",
        xlabel="batches in the gateway answer (sites x providers)",
        ylabel="ms CPU per poll",
        title="signals channel (about 555 B per batch)",
    )
    ax_sig.legend(fontsize=8)
    cands = [r["candidates"] for r in gateway]
    ax_gw.plot(
        cands, [statistics.median(r["ingest_ms"]) for r in gateway], marker="o", label="ingest + rebuild"
    )
    ax_gw.plot(
        cands, [statistics.median(r["rebuild_ms"]) for r in gateway], marker="s", label="rebuild alone"
    )
    ax_gw.set(
        xscale="log", yscale="log", xlabel="candidates", ylabel="ms CPU per poll", title="gateway store"
    )
    ax_gw.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# --- main -----------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per operator point (default 3)")
    parser.add_argument("--passes", type=int, default=6, help="measured passes per operator run (default 6)")
    parser.add_argument(
        "--rounds", type=int, default=20, help="timed calls per in-process point (default 20)"
    )
    parser.add_argument("--quick", action="store_true", help="1 repeat, 3 passes, 5 rounds")
    parser.add_argument("--json", type=Path, help="also write every measurement here")
    parser.add_argument(
        "--plot", type=Path, help="also draw the curves here (needs the bench extra: matplotlib)"
    )
    parser.add_argument("--serve-providers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--operator-child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--gateway-child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--client", choices=("lean", "httpx"), default="lean", help=argparse.SUPPRESS)
    parser.add_argument("--only", choices=("operator", "signals", "gateway", "poll"), help="run one curve")
    parser.add_argument(
        "--only-1000",
        action="store_true",
        help="the operator curve at 1000 providers x 16 slots only (and the --compare 'base' row): "
        "a quicker same-session comparison; no other curve, no scrape_cpu_share line",
    )
    parser.add_argument(
        "--compare",
        type=Path,
        help="also run 1000 providers x 16 slots on this tree's gridd (the 'base' row, interleaved "
        "with the others in every repeat) and compare the pass CPU outside the publishers",
    )
    parser.add_argument(
        "--src",
        type=Path,
        help="the operator curve runs the gridd package of this tree (e.g. an unchanged checkout, "
        "for a same-session comparison); the harness stays this one",
    )
    args = parser.parse_args()
    global OPERATOR_SRC, COMPARE_SRC
    if args.compare is not None:
        COMPARE_SRC = args.compare.resolve()
    if args.src is not None:
        OPERATOR_SRC = args.src.resolve()
        if args.operator_child:
            sys.path.insert(0, str(OPERATOR_SRC))
    if args.serve_providers:
        trio.run(serve_providers, args.serve_providers)
        return
    if args.operator_child:
        logging.basicConfig(level=logging.ERROR)
        print(json.dumps(trio.run(run_operator, args.operator_child, args.passes, args.client)))
        return
    if args.gateway_child:
        gateway_child(args.gateway_child)
        return
    if args.quick:
        args.repeats, args.passes, args.rounds = 1, 3, 5
    resource.setrlimit(resource.RLIMIT_NOFILE, (20000, 20000)) if resource.getrlimit(resource.RLIMIT_NOFILE)[
        0
    ] < 4096 else None
    print(
        f"sample: {SAMPLE.name}, {SAMPLE.stat().st_size} bytes; cpus: {os.cpu_count()}; "
        f"load average at start: {os.getloadavg()[0]:.2f}"
        + (f"; operator code: {OPERATOR_SRC}" if OPERATOR_SRC is not None else "")
        + (f"; base (compared) code: {COMPARE_SRC}" if COMPARE_SRC is not None else "")
    )
    only = {"signals": signals_curve, "gateway": gateway_curve, "poll": poll_cycle_curve}.get(args.only or "")
    if only is not None:
        only(args.rounds)
        return
    base = [(1000, 16, "base")] if COMPARE_SRC else []
    if args.only_1000:
        operator = operator_curve((1000,), args.repeats, args.passes, extra=base)
    else:
        # 1000 providers also with a pool four times wider (does the pass then fit the
        # interval?), and through the httpx client the operator used before, as the same-run
        # baseline.
        extra = [(1000, 64, "lean"), (1000, 16, "httpx"), *base]
        operator = operator_curve(PROVIDER_COUNTS, args.repeats, args.passes, extra=extra)
        lean_vs_httpx = statistics.median(
            r["cpu_per_pass_s"] for r in operator["points"]["1000x16"]
        ) / statistics.median(r["cpu_per_pass_s"] for r in operator["points"]["1000x16-httpx"])
        print(f"scrape CPU at 1000 providers, lean vs httpx, same run: {lean_vs_httpx:.3f}")
    if COMPARE_SRC is not None:
        for column, what in (("rest_cpu_per_pass_s", "outside the publishers"), ("cpu_per_pass_s", "in all")):
            now, base = (statistics.median(r[column] for r in operator["points"][key])
                         for key in ("1000x16", "1000x16-base"))
            print(f"CPU per pass at 1000 providers {what}, this code vs base, same run: "
                  f"{now:.3f} vs {base:.3f} ({now / base:.3f})")
    if args.only == "operator" or args.only_1000:
        return
    signals = signals_curve(args.rounds)
    gateway = gateway_curve(args.rounds)
    cycle = poll_cycle_curve(args.rounds)
    if args.json:
        args.json.write_text(
            json.dumps(
                {"operator": operator, "signals": signals, "gateway": gateway, "poll_cycle": cycle}, indent=1
            )
        )
    if args.plot:
        plot(operator, signals, gateway, args.plot)
    runs = operator["points"]["1000x16"]
    # CPU per pass over the interval: what scraping 1000 providers every 1 s costs, whether or
    # not the 16-slot pool lets a pass finish within the second.
    share = statistics.median(r["cpu_per_pass_s"] for r in runs) / 1.0
    print(f"scrape_cpu_share_1000={share:.3f}")


if __name__ == "__main__":
    main()
