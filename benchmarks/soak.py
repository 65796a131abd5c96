"""Soak (issue 15, docs/reliability.md): a two-site grid on loopback driven for a bounded time
with --concurrency streamed chat requests in flight, provider restarts every
--provider-restart-min minutes and one peer operator restart half-way.

    .venv/bin/python benchmarks/soak.py --minutes 10        # default 60

Everything runs on loopback in a temporary workspace (kept with --workspace): a grid CA and
certificates from `gridd certs`, two `gridd sim` backends, operators a and b peering over
mutual TLS, one gateway per site. Half the clients use gateway a, half gateway b; two client
processes (this script's `client` mode), each streaming with --concurrency/2 workers, one
request at a time each, a 60 s bound per request.

- Provider restart (every --provider-restart-min minutes, sites alternating), the way an
  operator restarts a provider (docs/reliability.md): `unavailable: true` through its
  operator's providers API, wait until both gateways exclude it (`gridctl explain`), wait
  until the simulator holds no request (bounded 90 s), stop it (SIGTERM), start it again on
  the same port, `unavailable: false`, wait until both gateways route to it again.
- Peer restart (once, at half time): operator b gets SIGTERM and starts again.

Every minute: throughput, latency percentiles (whole stream and first byte), answers by kind,
and RSS and open file descriptors of the four daemons. Answer kinds: `ok` (200 and the stream
ended with [DONE]), `designed` (429 or 503 with Retry-After), anything else is an error named
by what happened (`status_502`, `stream_cut`, `timeout`, `connect`, ...).

Last line: soak_ok=1 when every answer was ok or designed and every daemon's RSS at the end is
within 10% of its RSS at minute 5 (or at half time, for runs under 10 minutes); soak_ok=0
otherwise. Every loop is bounded in count and time; the run is capped at --minutes + 5.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from abuse import open_fds, pct, rss_mb, wait_for  # noqa: E402 - the benchmarks' shared helpers

from gridd.childprocs import free_ports, stop_processes  # noqa: E402

MODEL = "soak-model"
REQUEST_BOUND_S = 120.0
DRAIN_BOUND_S = 90.0


# ---------------------------------------------------------------------------------------------
# Client mode (a child process): streamed requests, one JSON line per finished minute


def client_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="soak.py client")
    parser.add_argument("--url", required=True)
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--until", type=float, required=True, help="wall-clock end (unix s)")
    parser.add_argument("--start", type=float, required=True, help="wall-clock start of minute 0")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--own-connection", action="store_true", help="a client (one pool) per worker")
    args = parser.parse_args(argv)

    import httpx
    import trio

    minutes: dict[int, dict] = {}
    seen_errors: set[str] = set()

    def bucket(t: float) -> dict:
        m = int((t - args.start) // 60)
        return minutes.setdefault(m, {"minute": m, "kinds": {}, "latency": [], "ttfb": []})

    def flush(upto: int) -> None:
        for m in sorted(k for k in minutes if k < upto):
            b = minutes.pop(m)
            lat, ttfb = b["latency"], b["ttfb"]
            print(json.dumps({"minute": m, "kinds": b["kinds"], "n": sum(b["kinds"].values()),
                              "p50": pct(lat, 0.5), "p90": pct(lat, 0.9), "p99": pct(lat, 0.99),
                              "ttfb_p50": pct(ttfb, 0.5), "ttfb_p99": pct(ttfb, 0.99)}), flush=True)

    async def one(shared: httpx.AsyncClient, i: int) -> None:
        if args.own_connection:
            async with httpx.AsyncClient(base_url=args.url, timeout=None) as own:
                await run(own, i)
        else:
            await run(shared, i)

    async def run(client: httpx.AsyncClient, i: int) -> None:
        body = {"model": MODEL, "stream": True, "max_tokens": args.max_tokens,
                "messages": [{"role": "user", "content": f"soak {i}"}]}
        while time.time() < args.until:
            started = time.monotonic()
            kind, first = "ok", None
            try:
                with trio.fail_after(REQUEST_BOUND_S):
                    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                        if r.status_code == 200:
                            done = False
                            async for line in r.aiter_lines():
                                if first is None:
                                    first = time.monotonic() - started
                                if line == "data: [DONE]":
                                    done = True
                            kind = "ok" if done else "stream_cut"
                        else:
                            await r.aread()
                            designed = r.status_code in (429, 503) and r.headers.get("retry-after")
                            kind = "designed" if designed else f"status_{r.status_code}"
            except trio.TooSlowError:
                kind = "timeout"
            except httpx.ConnectError:
                kind = "connect"
            except httpx.HTTPError as exc:
                kind = type(exc).__name__
                message = f"{kind}: {exc}"
                if message not in seen_errors and len(seen_errors) < 50:  # the client log says what each was
                    seen_errors.add(message)
                    print(f"{time.time() - args.start:.1f} s: {message}", file=sys.stderr, flush=True)
            now = time.time()
            b = bucket(now)
            b["kinds"][kind] = b["kinds"].get(kind, 0) + 1
            if kind == "ok":
                b["latency"].append(time.monotonic() - started)
                b["ttfb"].append(first if first is not None else float("nan"))
            if kind != "ok":
                await trio.sleep(0.2)  # a designed 503 asks to come back later; no hot loop

    async def main() -> None:
        # Idle connections expire on the client well before the gateway's 5 s keep-alive ends
        # them (DEFAULT_KEEP_ALIVE_S): reusing one the server is closing at that moment fails
        # with "Server disconnected without sending a response".
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=args.workers,
                              keepalive_expiry=2.0)
        async with httpx.AsyncClient(base_url=args.url, timeout=None, limits=limits) as client, \
                trio.open_nursery() as nursery:
            for i in range(args.workers):
                nursery.start_soon(one, client, i)
            while time.time() < args.until + REQUEST_BOUND_S:
                await trio.sleep(1)
                flush(int((time.time() - args.start) // 60))
                if time.time() >= args.until and not any(True for _ in nursery.child_tasks):
                    break
        flush(10**9)

    trio.run(main)
    return 0


# ---------------------------------------------------------------------------------------------
# The grid


class Grid:
    def __init__(self, ws: pathlib.Path, sim_args: list[str], max_connections: int) -> None:
        self.ws, self.sim_args, self.max_connections = ws, sim_args, max_connections
        names = ["sim-a", "sim-b", "sig-a", "sig-b", "api-a", "api-b", "gw-a", "gw-b"]
        self.p = dict(zip(names, free_ports(len(names)), strict=True))
        self.procs: dict[str, subprocess.Popen] = {}

    def certs(self) -> None:
        certs = self.ws / "certs"
        roles = (["--role", "operator"], ["--role", "gateway", "--replica", "g1"])
        commands = [["init"]] + [["issue", "--site", s, *role] for s in ("a", "b") for role in roles]
        for args in commands:
            subprocess.run([sys.executable, "-m", "gridd", "certs", args[0], str(certs), *args[1:]],
                           check=True, capture_output=True, timeout=60)

    def configs(self) -> None:
        p = self.p
        for site, other in (("a", "b"), ("b", "a")):
            (self.ws / f"op-{site}.yaml").write_text(f"""\
role: operator
site: {site}
tls: {{ca: certs/ca.pem, cert: certs/{site}-operator.pem, key: certs/{site}-operator-key.pem}}
listen: {{signals: "127.0.0.1:{p[f'sig-{site}']}", http: "127.0.0.1:{p[f'api-{site}']}"}}
control_socket: run/op-{site}.sock
state_dir: state/op-{site}
ingress: http://127.0.0.1:{p[f'gw-{site}']}
providers:
  - name: pool-{site}
    model: {MODEL}
    settings: {{endpoint: "http://127.0.0.1:{p[f'sim-{site}']}/v1"}}
    metrics: {{url: "http://127.0.0.1:{p[f'sim-{site}']}/metrics"}}
peers:
  - {{site: {other}, url: "wss://127.0.0.1:{p[f'sig-{other}']}/signals", ingress: "http://127.0.0.1:{p[f'gw-{other}']}"}}
timings: {{peer_poll_interval_s: 1, peer_poll_budget_s: 2}}
""")
            (self.ws / f"gw-{site}.yaml").write_text(f"""\
role: gateway
site: {site}
replica: g1
tls: {{ca: certs/ca.pem, cert: certs/{site}-gateway-g1.pem, key: certs/{site}-gateway-g1-key.pem}}
listen: {{http: "127.0.0.1:{p[f'gw-{site}']}"}}
control_socket: run/gw-{site}.sock
state_dir: state/gw-{site}
operator: {{url: "wss://127.0.0.1:{p[f'sig-{site}']}/signals"}}
availability: {{shedding: {{enabled: true}}}}
limits: {{http_max_connections: {self.max_connections}}}
""")

    def start(self, name: str) -> None:
        kind, site = name.split("-")
        args = (["sim", "--port", str(self.p[name]), "--model", MODEL, "--pool", f"pool-{site}",
                 *self.sim_args] if kind == "sim" else ["run", "--config", str(self.ws / f"{name}.yaml")])
        log = open(self.ws / f"{name}.log", "ab")  # noqa: SIM115 - lives with the child
        self.procs[name] = subprocess.Popen([sys.executable, "-m", "gridd", *args], stdout=log, stderr=log,
                                            cwd=self.ws)
        log.close()

    def stop(self, name: str, grace_s: float = 20.0) -> None:
        stop_processes([self.procs.pop(name)], grace_s=grace_s)

    def stop_all(self) -> None:
        procs, self.procs = list(self.procs.values()), {}
        stop_processes(procs, grace_s=20.0)

    def sim_admin(self, site: str, **knobs) -> dict:
        import httpx

        return httpx.post(f"http://127.0.0.1:{self.p[f'sim-{site}']}/admin", json=knobs, timeout=5).json()

    def set_unavailable(self, site: str, unavailable: bool) -> None:
        """The providers API of site's operator: pool-<site>'s administrative `unavailable`."""
        import httpx

        token = (self.ws / f"state/op-{site}/api-token").read_text().strip()
        r = httpx.post(f"http://127.0.0.1:{self.p[f'api-{site}']}/v1/providers/pool-{site}",
                       json={"unavailable": unavailable}, headers={"authorization": f"Bearer {token}"},
                       timeout=30)
        r.raise_for_status()

    def routable(self, gateway: str, site: str) -> bool:
        """Gateway's view (`gridctl explain`): pool-<site> is a candidate not excluded."""
        from gridd.control import request

        reply = request(self.ws / f"run/gw-{gateway}.sock", "explain", model=MODEL, timeout_s=10)
        views = [c for c in reply["explain"]["candidates"] if c["provider"] == f"pool-{site}"]
        return bool(views) and views[0]["excluded"] is None

    def restart_provider(self, site: str) -> tuple[float, list[str]]:
        """Restart pool-<site> the way an operator does (docs/reliability.md): mark it
        unavailable through the providers API, wait until both gateways exclude it, let the
        requests it holds finish, stop it (SIGTERM), start it, mark it available again and wait
        until both gateways route to it. Seconds it took, and each step's time."""
        import httpx

        began = time.monotonic()
        steps: list[str] = []

        def step(what: str, check, bound_s: float) -> None:
            try:
                wait_for(check, what, time.monotonic() + bound_s)
                steps.append(f"{what} {time.monotonic() - began:.1f} s")
            except TimeoutError:
                steps.append(f"{what} NOT within {bound_s:g} s")

        self.set_unavailable(site, True)
        step("excluded", lambda: not any(self.routable(g, site) for g in ("a", "b")), 30)
        step("drained", lambda: self.sim_admin(site)["in_flight"] == 0, DRAIN_BOUND_S)
        self.stop(f"sim-{site}")
        self.start(f"sim-{site}")
        step("started", lambda: httpx.get(f"http://127.0.0.1:{self.p[f'sim-{site}']}/health",
                                         timeout=2).status_code == 200, 30)
        self.set_unavailable(site, False)
        step("routed", lambda: all(self.routable(g, site) for g in ("a", "b")), 30)
        return time.monotonic() - began, steps

    def ready(self, site: str) -> bool:
        import httpx

        return httpx.get(f"http://127.0.0.1:{self.p[f'gw-{site}']}/readyz", timeout=2).status_code == 200


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--concurrency", type=int, default=1000,
                        help="streamed requests in flight, both sites")
    parser.add_argument("--provider-restart-min", type=float, default=3.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    # Long, slow streams: 1000 held at once at a chunk rate two shared cores can carry
    # (16 tokens at 2.5 s: about 40 s a stream, 25 requests/s, 400 chunks/s in all).
    parser.add_argument("--sim", default="--endpoints 8 --max-seqs 96 --ttft-s 0.5 --tpot-s 2.5",
                        help="gridd sim flags of both backends")
    # Each gateway's front holds its own clients' connections and the other gateway's pooled
    # ingress connections: at 1000 streams close to the 1024 default, past which idle
    # keep-alive connections are evicted. The soak measures the grid, not that cap.
    parser.add_argument("--http-max-connections", type=int, default=4096,
                        help="gateways' limits.http_max_connections")
    # Like a fleet of independent clients, each stream worker has its own httpx client. One pool
    # shared by 500 trio tasks (--no-client-per-worker) makes ~1% client-side failures of its
    # own at 1000 streams ("Server disconnected without sending a response", "this socket was
    # already closed"), none with a client per worker (docs/reliability.md).
    parser.add_argument("--client-per-worker", action=argparse.BooleanOptionalAction, default=True,
                        help="each stream worker its own httpx client (default)")
    parser.add_argument("--workspace", help="keep configs and logs here (default: a temporary directory)")
    parser.add_argument("--out", help="write the per-minute records as JSON here")
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.concurrency < 2:
        parser.error("--minutes must be positive and --concurrency at least 2")
    # Started in the background (`&`), SIGINT is ignored: SIGTERM stops the grid and clients too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    ws = pathlib.Path(args.workspace or tempfile.mkdtemp(prefix="gridd-soak-"))
    ws.mkdir(parents=True, exist_ok=True)
    grid = Grid(ws, args.sim.split(), args.http_max_connections)
    clients: list[subprocess.Popen] = []
    records: list[dict] = []
    events: list[str] = []
    try:
        grid.certs()
        grid.configs()
        for name in ("sim-a", "sim-b", "op-a", "op-b", "gw-a", "gw-b"):
            grid.start(name)
        for site in ("a", "b"):
            wait_for(lambda site=site: grid.ready(site), f"gateway {site} ready", time.monotonic() + 60)
        time.sleep(3)  # both sites' readings at both gateways

        start = time.time()
        until = start + args.minutes * 60
        cap = time.monotonic() + args.minutes * 60 + 300
        for site in ("a", "b"):
            out = open(ws / f"client-{site}.jsonl", "wb")  # noqa: SIM115 - lives with the child
            err = open(ws / f"client-{site}.log", "ab")  # noqa: SIM115 - lives with the child
            own = ["--own-connection"] if args.client_per_worker else []
            clients.append(subprocess.Popen(
                [sys.executable, __file__, "client", "--url", f"http://127.0.0.1:{grid.p[f'gw-{site}']}",
                 "--workers", str(args.concurrency // 2), "--until", str(until), "--start", str(start),
                 "--max-tokens", str(args.max_tokens), *own],
                stdout=out, stderr=err))
            out.close()
            err.close()
        print(f"soak: {args.minutes:g} min, {args.concurrency} streams in flight, workspace {ws}", flush=True)
        print("minute  req/s   ok  designed errors           p50_s  p99_s  ttfb_p99  "
              "rss_mb gw-a/gw-b/op-a/op-b       fds gw-a/gw-b/op-a/op-b", flush=True)

        daemons = ("gw-a", "gw-b", "op-a", "op-b")
        next_restart = args.provider_restart_min * 60
        restart_site = "a"
        peer_restarted = False
        restarted_at: dict[str, float] = {}  # daemon -> elapsed minutes at its restart
        minute = 0
        while time.time() < until and time.monotonic() < cap:
            elapsed = time.time() - start
            if elapsed >= next_restart:
                took, steps = grid.restart_provider(restart_site)
                events.append(f"{elapsed / 60:.1f} min: provider pool-{restart_site} restarted in "
                              f"{took:.1f} s ({', '.join(steps)})")
                restart_site = "b" if restart_site == "a" else "a"
                next_restart += args.provider_restart_min * 60
            if not peer_restarted and elapsed >= args.minutes * 30 + 20:  # not on a sample's second
                grid.stop("op-b")
                grid.start("op-b")
                peer_restarted = True
                restarted_at["op-b"] = elapsed / 60
                events.append(f"{elapsed / 60:.1f} min: peer operator b restarted (SIGTERM + start)")
            if elapsed >= (minute + 1) * 60:
                records.append({"minute": minute + 1,
                                "rss_mb": {d: rss_mb(grid.procs[d].pid) for d in daemons},
                                "fds": {d: open_fds(grid.procs[d].pid) for d in daemons}})
                minute += 1
            time.sleep(1)
        records.append({"minute": minute + 1, "rss_mb": {d: rss_mb(grid.procs[d].pid) for d in daemons},
                        "fds": {d: open_fds(grid.procs[d].pid) for d in daemons}})
        for c in clients:
            c.wait(timeout=REQUEST_BOUND_S + 30)
    finally:
        for c in clients:
            if c.poll() is None:
                c.kill()
        grid.stop_all()

    # Merge the clients' minutes with the samples (client minute m = the minute ending at m+1).
    by_minute: dict[int, dict] = {}
    for site in ("a", "b"):
        for line in (ws / f"client-{site}.jsonl").read_text().splitlines():
            rec = json.loads(line)
            agg = by_minute.setdefault(rec["minute"] + 1,
                                       {"kinds": {}, "p50": [], "p99": [], "ttfb_p99": [], "n": 0})
            for k, v in rec["kinds"].items():
                agg["kinds"][k] = agg["kinds"].get(k, 0) + v
            agg["n"] += rec["n"]
            for q in ("p50", "p99", "ttfb_p99"):
                agg[q].append(rec[q])
    totals: dict[str, int] = {}
    for rec in records:
        agg = by_minute.get(rec["minute"], {"kinds": {}, "n": 0, "p50": [], "p99": [], "ttfb_p99": []})
        rec.update(kinds=agg["kinds"], n=agg["n"],
                   p50_s=max(agg["p50"], default=float("nan")), p99_s=max(agg["p99"], default=float("nan")),
                   ttfb_p99_s=max(agg["ttfb_p99"], default=float("nan")))
        for k, v in agg["kinds"].items():
            totals[k] = totals.get(k, 0) + v
        errors = {k: v for k, v in rec["kinds"].items() if k not in ("ok", "designed")}
        rss = "/".join(f"{v:.0f}" if v else "?" for v in rec["rss_mb"].values())
        print(f"{rec['minute']:>6} {rec['n'] / 60:>6.1f} {rec['kinds'].get('ok', 0):>6} "
              f"{rec['kinds'].get('designed', 0):>6} "
              f"{json.dumps(errors) if errors else '-':<16} {rec['p50_s']:>6.2f} {rec['p99_s']:>6.2f} "
              f"{rec['ttfb_p99_s']:>8.2f}  {rss:<26} {'/'.join(str(v) for v in rec['fds'].values())}")
    for e in events:
        print("event:", e)
    errors = {k: v for k, v in totals.items() if k not in ("ok", "designed")}
    # Each daemon's RSS at the end against minute 5 (half time for runs under 10 minutes); a
    # daemon restarted after that is compared with its first sample a whole minute after (or,
    # in a run too short for one, with the last sample).
    base_minute = 5 if args.minutes >= 10 else max(1, int(args.minutes / 2))
    end = records[-1] if records else None
    base: dict[str, tuple[int, float]] = {}
    for d in daemons:
        after = min(max(base_minute, int(restarted_at.get(d, 0.0)) + 2), end["minute"] if end else 0)
        sample = next((r for r in records if r["minute"] >= after and r["rss_mb"][d]), None)
        if sample is not None:
            base[d] = (sample["minute"], sample["rss_mb"][d])
    rss_ok = end is not None and len(base) == len(daemons) and all(
        end["rss_mb"][d] and end["rss_mb"][d] <= 1.10 * mb for d, (_, mb) in base.items())
    print(f"totals: {json.dumps(totals)}; errors: {json.dumps(errors) if errors else 'none'}")
    if end:
        shares = ", ".join(f"{d} {end['rss_mb'][d] or 0:.0f} MB (minute {m}: {mb:.0f})"
                           for d, (m, mb) in base.items())
        print(f"rss at the end: {shares}")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(
            {"args": vars(args), "records": records, "events": events, "totals": totals}, indent=1))
    if not args.workspace:
        shutil.rmtree(ws, ignore_errors=True)
    ok = not errors and rss_ok and totals.get("ok", 0) > 0
    print(f"soak_ok={int(ok)}")
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "client":
        sys.exit(client_main(sys.argv[2:]))
    sys.exit(main(sys.argv[1:]))
