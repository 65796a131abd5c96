"""Abuse benchmark (docs/security.md): a real gateway and operator under the security issue's
attacks, with a well-behaved client measuring what it still gets.

    .venv/bin/python benchmarks/abuse.py [--connections 2000] [--flood-names 5000] [--attack-s 40]

Everything runs on loopback in a temporary workspace: a grid CA and certificates from
`gridd certs`, a `gridd sim` backend, operator a (its peer b is the flood peer below) and
gateway a. After a warm-up (the idle RSS of each daemon is the median of its samples in the
last idle window), the attack runs for --attack-s seconds:

- slow bodies: --connections connections to the gateway's front, each sending a chat request
  head announcing --initial-kib + 1 MiB of body, --initial-kib of it at once, then one byte
  every 8 s (the
  issue's trickle, under the 10 s idle bound). Opened once, as fast as the gateway accepts;
  not reopened when the server closes them.
- peer flood: a fake peer operator with site b's valid operator certificate (this script's
  `flood-peer` mode, a child process) answers every poll (1 s) with --flood-names provider
  names never sent before.
- a well-behaved client sends a non-streamed chat completion every 50 ms, each on a NEW
  connection (so it must get past the connection cap), and records its latency.

RSS of both daemons is sampled every 0.25 s. Every loop is bounded in count and time; the whole
run is capped by RUN_CAP_S. Last line: abuse_ok=1 when the peak RSS of each daemon stays under
2x its idle value, every well-behaved request was answered 200, and their p99 latency is under
100 ms; abuse_ok=0 otherwise.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import trio
import trio.lowlevel

from gridd.childprocs import free_ports, stop_processes

MODEL = "abuse-model"
RUN_CAP_S = 240.0  # the whole benchmark, start to end
IDLE_S = 6.0
SAMPLE_EVERY_S = 0.25
GOOD_EVERY_S = 0.05
TRICKLE_EVERY_S = 8.0
BODY_BYTES = 1024 * 1024
P99_BOUND_MS = 100.0


def rss_mb(pid: int) -> float | None:
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def open_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


# ---------------------------------------------------------------------------------------------
# The flood peer (child process): a peer operator with a valid certificate and endless names


async def flood_peer(certs: pathlib.Path, site: str, port: int, names: int, long_name_chars: int = 0) -> None:
    from gridd.core.readings import Revision
    from gridd.link.serve import serve_channel
    from gridd.tls import server_context
    from gridd.wire import PROTOCOL_VERSION, Batch, Batches, Poll

    ctx = server_context(str(certs / f"{site}-operator.pem"), str(certs / f"{site}-operator-key.pem"),
                         str(certs / "ca.pem"))
    polls = itertools.count()
    epoch = int(time.time()) - 60

    async def handler(session) -> None:
        while True:
            msg = await session.receive()
            if not isinstance(msg, Poll):
                continue
            n = next(polls)
            now_ms = int(time.time() * 1000)
            batches = tuple(Batch(site=site, provider=f"flood-{n}-{i}", model=MODEL,
                                  published_ms=now_ms, age_s=0.0,
                                  revision=Revision("uid", 1, epoch, n + 1, 0), ready=True)
                            for i in range(names))
            if long_name_chars:  # the 100 kB name that became a /metrics label
                batches += (Batch(site=site, provider="long-" + "x" * long_name_chars, model=MODEL,
                                  published_ms=now_ms, age_s=0.0,
                                  revision=Revision("uid", 1, epoch, n + 1, 0), ready=True),)
            await session.send(Batches(protocol=PROTOCOL_VERSION, sent_wall=time.time(), batches=batches))

    await serve_channel(f"127.0.0.1:{port}", lambda: ctx, handler)


# ---------------------------------------------------------------------------------------------
# The attack on the gateway's front


class SlowBodies:
    def __init__(self, port: int, connections: int, initial: bytes) -> None:
        self.port = port
        self.connections = connections
        self.initial = initial
        self.opened = 0
        self.failed_to_open = 0
        self.closed_by_server = 0
        self.answers: dict[str, int] = {}

    async def one(self) -> None:
        try:
            stream = await trio.open_tcp_stream("127.0.0.1", self.port)
        except OSError:
            self.failed_to_open += 1
            return
        self.opened += 1
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                f"content-length: {len(self.initial) + BODY_BYTES}\r\n\r\n").encode()
        try:
            async with stream:
                await stream.send_all(head + self.initial)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._trickle, stream, nursery.cancel_scope)
                    answer = b""
                    while chunk := await stream.receive_some(4096):
                        answer += chunk
                    answered = answer.startswith(b"HTTP/1.1 ")
                    status = answer.split(b" ", 2)[1].decode() if answered else "closed"
                    self.answers[status] = self.answers.get(status, 0) + 1
                    self.closed_by_server += 1
                    nursery.cancel_scope.cancel()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            self.closed_by_server += 1
            self.answers["reset"] = self.answers.get("reset", 0) + 1

    @staticmethod
    async def _trickle(stream: trio.SocketStream, done: trio.CancelScope) -> None:
        while True:
            await trio.sleep(TRICKLE_EVERY_S)
            try:
                await stream.send_all(b" ")
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                done.cancel()
                return

    async def run(self, duration_s: float) -> None:
        with trio.move_on_after(duration_s):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.sleep, duration_s)  # the attack (and the flood) last this long
                for _ in range(self.connections):
                    nursery.start_soon(self.one)
                    await trio.lowlevel.checkpoint()


class GoodClient(threading.Thread):
    """A non-streamed chat completion every GOOD_EVERY_S, each on a new connection."""

    def __init__(self, port: int, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.stop = stop
        self.latencies_ms: list[float] = []
        self.statuses: dict[str, int] = {}

    def run(self) -> None:
        body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hello"}]}
        limits = httpx.Limits(max_keepalive_connections=0)
        with httpx.Client(timeout=10.0, limits=limits) as client:
            while not self.stop.is_set():
                start = time.perf_counter()
                try:
                    url = f"http://127.0.0.1:{self.port}/v1/chat/completions"
                    status = str(client.post(url, json=body).status_code)
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                self.latencies_ms.append((time.perf_counter() - start) * 1000)
                self.statuses[status] = self.statuses.get(status, 0) + 1
                self.stop.wait(max(0.0, GOOD_EVERY_S - (time.perf_counter() - start)))


class RssSampler(threading.Thread):
    def __init__(self, pids: dict[str, int], stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.pids = pids
        self.stop = stop
        self.samples: dict[str, list[tuple[float, float]]] = {name: [] for name in pids}
        self.fds: dict[str, int] = dict.fromkeys(pids, 0)

    def run(self) -> None:
        while not self.stop.is_set():
            now = time.monotonic()
            for name, pid in self.pids.items():
                value = rss_mb(pid)
                if value is not None:
                    self.samples[name].append((now, value))
                self.fds[name] = max(self.fds[name], open_fds(pid))
            self.stop.wait(SAMPLE_EVERY_S)

    def between(self, name: str, start: float, end: float) -> list[float]:
        return [v for t, v in self.samples[name] if start <= t <= end]


# ---------------------------------------------------------------------------------------------
# Set-up


def gridd(*args: str, log: pathlib.Path) -> subprocess.Popen:
    out = open(log, "ab")  # noqa: SIM115 - lives with the child
    return subprocess.Popen([sys.executable, "-m", "gridd", *args], stdout=out, stderr=out)


def write_configs(ws: pathlib.Path, p: dict[str, int]) -> None:
    (ws / "operator.yaml").write_text(f"""\
role: operator
site: a
tls: {{ca: certs/ca.pem, cert: certs/a-operator.pem, key: certs/a-operator-key.pem}}
listen: {{signals: "127.0.0.1:{p['sig']}", http: "127.0.0.1:{p['api']}"}}
control_socket: run/operator.sock
state_dir: state/operator
providers:
  - name: pool-a
    model: {MODEL}
    settings: {{endpoint: "http://127.0.0.1:{p['sim']}/v1"}}
    metrics: {{url: "http://127.0.0.1:{p['sim']}/metrics"}}
peers:
  - {{site: b, url: "wss://127.0.0.1:{p['peer']}/signals"}}
timings: {{peer_poll_interval_s: 1, peer_poll_budget_s: 2}}
""")
    (ws / "gateway.yaml").write_text(f"""\
role: gateway
site: a
replica: g1
tls: {{ca: certs/ca.pem, cert: certs/a-gateway-g1.pem, key: certs/a-gateway-g1-key.pem}}
listen: {{http: "127.0.0.1:{p['gw']}"}}
control_socket: run/gateway.sock
state_dir: state/gateway
operator: {{url: "wss://127.0.0.1:{p['sig']}/signals"}}
""")


def operator_peer_status(ws: pathlib.Path) -> dict:
    out = subprocess.run([sys.executable, "-c",
                          "from gridd.cli import gridctl_main; raise SystemExit(gridctl_main())",
                          "--socket", str(ws / "run" / "operator.sock"), "status", "--json"],
                         capture_output=True, text=True, timeout=30)
    status = json.loads(out.stdout)["status"]["role_status"]
    peer = status["peers"][0]
    return {"polls": peer["polls"], "batches": peer["batches"], "refused": peer.get("refused"),
            "held_readings": status["held_readings"]}


def wait_for(check, what: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (httpx.HTTPError, OSError, ValueError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{what} not ready")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=2000)
    parser.add_argument("--flood-names", type=int, default=5000)
    parser.add_argument("--attack-s", type=float, default=40.0)
    parser.add_argument("--initial-kib", type=int, default=16,
                        help="body bytes each slow connection sends first")
    parser.add_argument("--workspace", help="keep configs and logs here (default: a temporary directory)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    run_deadline = started + RUN_CAP_S

    # 2000 client sockets here and as many accepted by the gateway: raise the soft descriptor
    # limit to the hard one (the daemons inherit it, as under systemd's LimitNOFILE).
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    print(f"RLIMIT_NOFILE soft {soft} -> {hard}")

    ws = pathlib.Path(args.workspace or tempfile.mkdtemp(prefix="gridd-abuse-")).resolve()
    ws.mkdir(parents=True, exist_ok=True)
    certs = ws / "certs"
    if not (certs / "ca.pem").exists():
        subprocess.run([sys.executable, "-m", "gridd", "certs", "init", str(certs)], check=True,
                       capture_output=True)
    for site, role in (("a", ["--role", "operator"]), ("a", ["--role", "gateway", "--replica", "g1"]),
                       ("b", ["--role", "operator"])):
        subprocess.run([sys.executable, "-m", "gridd", "certs", "issue", "--site", site, *role, str(certs)],
                       check=True, capture_output=True)
    p = dict(zip(["sim", "sig", "api", "gw", "peer"], free_ports(5), strict=True))
    write_configs(ws, p)
    procs: dict[str, subprocess.Popen] = {}
    stop = threading.Event()
    try:
        procs["sim"] = gridd("sim", "--port", str(p["sim"]), "--model", MODEL, "--endpoints", "4",
                             "--max-seqs", "16",
                             "--ttft-s", "0.002", "--tpot-s", "0.001", "--pool", "pool-a", log=ws / "sim.log")
        procs["operator"] = gridd("run", "--config", str(ws / "operator.yaml"), log=ws / "operator.log")
        procs["gateway"] = gridd("run", "--config", str(ws / "gateway.yaml"), log=ws / "gateway.log")
        gw = f"http://127.0.0.1:{p['gw']}"
        body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        wait_for(lambda: httpx.post(f"{gw}/v1/chat/completions", json=body, timeout=5).status_code == 200,
                 "the gateway serving", min(run_deadline, time.monotonic() + 60))

        sampler = RssSampler({"gateway": procs["gateway"].pid, "operator": procs["operator"].pid}, stop)
        sampler.start()
        good = GoodClient(p["gw"], stop)
        good.start()
        time.sleep(IDLE_S)  # warm-up, then the idle window
        idle_start = time.monotonic()
        time.sleep(IDLE_S)
        idle_end = time.monotonic()
        idle = {name: statistics.median(sampler.between(name, idle_start, idle_end)) for name in sampler.pids}
        good_before = len(good.latencies_ms)
        statuses_before = dict(good.statuses)

        procs["peer"] = subprocess.Popen([sys.executable, __file__, "flood-peer", "--certs", str(certs),
                                          "--port", str(p["peer"]), "--names", str(args.flood_names)],
                                         stdout=subprocess.DEVNULL,
                                         stderr=open(ws / "peer.log", "ab"))  # noqa: SIM115
        attack_start = time.monotonic()
        slow = SlowBodies(p["gw"], args.connections, b"{" + b" " * (args.initial_kib * 1024 - 1))
        trio.run(slow.run, min(args.attack_s, run_deadline - time.monotonic() - 20))
        attack_end = time.monotonic()
        latencies = good.latencies_ms[good_before:]
        statuses = {k: v - statuses_before.get(k, 0) for k, v in good.statuses.items()
                    if v - statuses_before.get(k, 0)}
        peak = {name: max(sampler.between(name, attack_start, attack_end), default=float("nan"))
                for name in sampler.pids}
        flood = operator_peer_status(ws)
        stop.set()
        good.join(timeout=15)
        sampler.join(timeout=5)

        if args.workspace:
            print(f"workspace {ws} (configs, certificates, logs)")
        print(f"attack: {args.connections} slow-body connections to the gateway ({args.initial_kib} KiB, "
              f"then 1 byte per {TRICKLE_EVERY_S:g} s) + a peer flooding {args.flood_names} new provider "
              f"names per 1 s poll, for {attack_end - attack_start:.1f} s")
        for name in sampler.pids:
            print(f"{name}: idle_rss_mb={idle[name]:.1f} peak_rss_mb={peak[name]:.1f} "
                  f"ratio={peak[name] / idle[name]:.2f} peak_fds={sampler.fds[name]}")
        print(f"slow bodies: opened={slow.opened} failed_to_open={slow.failed_to_open} "
              f"closed_by_server={slow.closed_by_server} answers={dict(sorted(slow.answers.items()))}")
        print(f"peer flood at the operator: {json.dumps(flood, sort_keys=True)}")
        for name in ("gateway", "operator"):
            lines = (ws / f"{name}.log").read_text(errors="replace").splitlines()
            refusals = sum("refusing" in line for line in lines)
            print(f"{name} log: {len(lines)} lines in all, {refusals} about refusals")
        print(f"well-behaved client during the attack: requests={len(latencies)} statuses={statuses} "
              f"p50_ms={pct(latencies, 0.50):.1f} p99_ms={pct(latencies, 0.99):.1f} "
              f"max_ms={max(latencies):.1f}")
        ok = (all(peak[name] < 2 * idle[name] for name in sampler.pids) and latencies
              and set(statuses) == {"200"} and pct(latencies, 0.99) < P99_BOUND_MS)
        print(f"run_s={time.monotonic() - started:.1f}")
        print(f"abuse_ok={1 if ok else 0}")
        return 0 if ok else 1
    finally:
        stop.set()
        stop_processes(procs.values(), grace_s=20)
        if not args.workspace:
            shutil.rmtree(ws, ignore_errors=True)


def flood_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="abuse.py flood-peer")
    parser.add_argument("--certs", required=True)
    parser.add_argument("--site", default="b")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--names", type=int, default=5000)
    parser.add_argument("--long-name-chars", type=int, default=0,
                        help="also send one name this long per poll")
    args = parser.parse_args(argv)
    try:
        trio.run(flood_peer, pathlib.Path(args.certs), args.site, args.port, args.names, args.long_name_chars)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["flood-peer"]:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        sys.exit(flood_main(sys.argv[2:]))
    sys.exit(main(sys.argv[1:]))
