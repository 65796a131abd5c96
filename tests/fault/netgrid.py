"""A two-site gridd grid on network namespaces of its own (issue 15's fault suite).

Topology, all inside namespaces this module creates and deletes (no address of the host's):

    ns <tag>-a  (10.231.0.1/24, s<tag>a) --veth-- (p<tag>a) [br0 in ns <tag>-br]
                                                  (p<tag>b) --veth-- (s<tag>b, 10.231.0.2/24)  ns <tag>-b

Per site namespace: a simulator (127.0.0.1:8001), an operator (metrics 127.0.0.1:9100,
signals 0.0.0.0:7443, which inside the namespace is loopback and the site's own address), a
gateway (front 0.0.0.0:8080, metrics 127.0.0.1:9101). Every process is `ip netns exec`'d, so its
pid is the gridd process itself (kill -9 and SIGSTOP reach it). A cut is the bridge side of a
site's veth taken down: the site keeps its address and its loopback, carrier is lost, and
packets towards the other site go nowhere (a cable pulled at the switch).

The test process reaches a namespace from a thread that joins it (``inside``): setns(2)
moves only the calling thread, and sockets keep the namespace they were created in.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from realproc import Processes, gridctl_status, series, wait_until

CLONE_NEWNET = 0x40000000
SITES = ("a", "b")
ADDR = {"a": "10.231.0.1", "b": "10.231.0.2"}
SIM_PORT, OP_METRICS, OP_SIGNALS, GW_HTTP, GW_METRICS = 8001, 9100, 7443, 8080, 9101
MODEL = "fault-model"
# Fast timings so every rule shows within seconds: peer poll 1 s (budget 2 s), signal TTL 4 s
# (stale after 4 s, silent after 8 s), the gateway's 1 s poll, scrapes every 1 s.
TIMINGS = "{peer_poll_interval_s: 1, peer_poll_budget_s: 2, signal_ttl_s: 4, stale_metrics_s: 2}"
TTL_S = 4.0
_NS_PREFIX = "gridd-fault-"


def unavailable_reason() -> str | None:
    """Why the fault suite cannot run here, or None."""
    if os.geteuid() != 0:
        return "the fault suite creates network namespaces and veth pairs: it needs root"
    if shutil.which("ip") is None:
        return "the fault suite needs `ip` (iproute2) for `ip netns` and veth pairs"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    if probe.returncode != 0:
        return f"`ip netns` does not work here: {probe.stderr.strip()}"
    return None


def ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


_libc = ctypes.CDLL(None, use_errno=True)


def _setns(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


@contextlib.contextmanager
def inside(netns: str) -> Iterator[None]:
    """Run the block with this thread in network namespace ``netns``, then come back."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        _setns(f"/var/run/netns/{netns}")
        try:
            yield
        finally:
            if _libc.setns(home, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back to the test's namespace failed")
    finally:
        os.close(home)


def remove_leftovers() -> None:
    """Delete namespaces a killed earlier run of this suite left (their pid is gone)."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    for name in re.findall(rf"^({_NS_PREFIX}(\d+)-\w+)", listing, re.M):
        if not Path(f"/proc/{name[1]}").exists():
            subprocess.run(["ip", "netns", "del", name[0]], capture_output=True, timeout=10)


def issue_certs(directory: Path, *, issued_ago_s: float = 0.0) -> None:
    """A grid CA and a leaf per host of the two sites (`gridd certs`), issued as if
    ``issued_ago_s`` ago (a host whose clock runs behind still finds them valid)."""
    import types
    from unittest import mock

    import gridd.certs

    commands = [["init"]]
    for site in SITES:
        commands += [["issue", "--site", site, "--role", "operator"],
                     ["issue", "--site", site, "--role", "gateway", "--replica", "g1"]]
    clock = types.SimpleNamespace(time=lambda: time.time() - issued_ago_s)
    with mock.patch.object(gridd.certs, "time", clock), contextlib.redirect_stdout(None):
        for args in commands:
            assert gridd.certs.main([args[0], str(directory), *args[1:]]) == 0, args


@dataclass
class Grid:
    """Two sites, one namespace each, bridged through a third. Use as a context manager:
    on the way out every process is stopped and every namespace deleted, also on failure."""

    dir: Path
    certs: Path
    # Per process name (sim-a, op-a, gw-a, ...): extra environment, e.g. a clock offset.
    env: dict[str, dict[str, str]] = field(default_factory=dict)
    # Site a's operator dials site b's through a DelayProxy in a's namespace (``self.proxy``).
    proxied_peer_link: bool = False
    # The gateways that must hold both sites fresh before the grid is handed over.
    converge: tuple[str, ...] = SITES
    sim_args: tuple[str, ...] = ("--endpoints", "2", "--max-seqs", "8",
                                 "--ttft-s", "0.02", "--tpot-s", "0.01")

    def __post_init__(self) -> None:
        self.tag = str(os.getpid())
        self.ns = {site: f"{_NS_PREFIX}{self.tag}-{site}" for site in SITES}
        self.bridge_ns = f"{_NS_PREFIX}{self.tag}-br"
        self.procs = Processes(self.dir)
        self._made: list[str] = []
        self.proxy: DelayProxy | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    def __enter__(self) -> Grid:
        try:
            self._network()
            if self.proxied_peer_link:
                self.proxy = DelayProxy(self.ns["a"], (ADDR["b"], OP_SIGNALS))
            self._configs()
            for site in SITES:
                self.start("sim", site)
            for site in SITES:
                self.start("op", site)
                self.start("gw", site)
            self.wait_converged()
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.procs.__exit__(exc_type, exc, tb)
        finally:
            if self.proxy is not None:
                self.proxy.close()
            for name in reversed(self._made):
                subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
            self._made.clear()

    def _network(self) -> None:
        remove_leftovers()
        for name in (self.bridge_ns, *self.ns.values()):
            ip("netns", "add", name)
            self._made.append(name)
            ip("-n", name, "link", "set", "lo", "up")
        ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        for site in SITES:
            inner, outer = f"s{self.tag}{site}", f"p{self.tag}{site}"
            ip("link", "add", inner, "netns", self.ns[site], "type", "veth", "peer", "name", outer,
               "netns", self.bridge_ns)
            ip("-n", self.ns[site], "addr", "add", f"{ADDR[site]}/24", "dev", inner)
            ip("-n", self.ns[site], "link", "set", inner, "up")
            ip("-n", self.bridge_ns, "link", "set", outer, "master", "br0")
            ip("-n", self.bridge_ns, "link", "set", outer, "up")

    def cut(self, site: str) -> None:
        """Pull ``site``'s cable at the bridge: it keeps its address and loopback."""
        ip("-n", self.bridge_ns, "link", "set", f"p{self.tag}{site}", "down")

    def restore(self, site: str) -> None:
        ip("-n", self.bridge_ns, "link", "set", f"p{self.tag}{site}", "up")

    def _configs(self) -> None:
        # `certs` is a symlink to a directory, so a rotation can switch every file at once
        # (test_fault_restarts.py: reissue_leaves).
        shutil.copytree(self.certs, self.dir / "certs.0", dirs_exist_ok=True)
        if not (self.dir / "certs").is_symlink():
            os.symlink("certs.0", self.dir / "certs")
        for site in SITES:
            other = "b" if site == "a" else "a"
            peer = (f"127.0.0.1:{self.proxy.port}" if self.proxy and site == "a"
                    else f"{ADDR[other]}:{OP_SIGNALS}")
            (self.dir / f"op-{site}.yaml").write_text(f"""
role: operator
site: {site}
tls: {{ca: certs/ca.pem, cert: certs/{site}-operator.pem, key: certs/{site}-operator-key.pem}}
listen: {{metrics: "127.0.0.1:{OP_METRICS}", signals: "0.0.0.0:{OP_SIGNALS}"}}
control_socket: run/op-{site}.sock
state_dir: state/op-{site}
drain_grace_s: 2
ingress: http://{ADDR[site]}:{GW_HTTP}
providers:
  - name: pool-{site}
    model: {MODEL}
    settings: {{endpoint: "http://127.0.0.1:{SIM_PORT}/v1"}}
    metrics: {{url: "http://127.0.0.1:{SIM_PORT}/metrics", timeout_s: 1}}
peers:
  - {{site: {other}, url: "wss://{peer}/signals", ingress: "http://{ADDR[other]}:{GW_HTTP}"}}
timings: {TIMINGS}
""")
            (self.dir / f"gw-{site}.yaml").write_text(f"""
role: gateway
site: {site}
replica: g1
tls: {{ca: certs/ca.pem, cert: certs/{site}-gateway-g1.pem, key: certs/{site}-gateway-g1-key.pem}}
listen: {{http: "0.0.0.0:{GW_HTTP}", metrics: "127.0.0.1:{GW_METRICS}"}}
control_socket: run/gw-{site}.sock
state_dir: state/gw-{site}
drain_grace_s: 2
operator: {{url: "wss://127.0.0.1:{OP_SIGNALS}/signals"}}
timings: {TIMINGS}
""")

    def start(self, kind: str, site: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start (or restart) process ``kind`` (sim, op, gw) of ``site`` in its namespace."""
        name = f"{kind}-{site}"
        args = (["sim", "--port", str(SIM_PORT), "--model", MODEL, "--pool", f"pool-{site}", *self.sim_args]
                if kind == "sim" else ["run", "--config", f"{name}.yaml"])
        return self.procs.start(name, *args, env={**self.env.get(name, {}), **(env or {})},
                                prefix=("ip", "netns", "exec", self.ns[site]))

    def pid(self, name: str) -> int:
        return self.procs.procs[name].pid

    # -- observation ----------------------------------------------------------------------------

    def get(self, site: str, url: str, timeout: float = 5.0) -> httpx.Response:
        with inside(self.ns[site]):
            return httpx.get(url, timeout=timeout)

    def metrics(self, site: str, kind: str = "op") -> str:
        port = OP_METRICS if kind == "op" else GW_METRICS
        return self.get(site, f"http://127.0.0.1:{port}/metrics").text

    def status(self, name: str) -> dict:
        found = gridctl_status(self.dir / "run" / f"{name}.sock")
        if found is None:
            raise ValueError(f"{name}: no status yet")
        return found

    def candidates(self, gateway_site: str) -> dict[str, dict]:
        """The gateway's candidates by site (one provider per site here)."""
        return {c["site"]: c for c in self.status(f"gw-{gateway_site}")["role_status"]["candidates"]}

    def wait_converged(self, deadline_s: float = 60.0) -> None:
        """Both gateways hold both sites fresh and ready, and answer /readyz."""
        readyz = f"http://127.0.0.1:{GW_HTTP}/readyz"
        for site in self.converge:
            wait_until(lambda site=site: all(c["signal"] == "fresh" and c["ready"] and not c["excluded"]
                                             for c in self.candidates(site).values())
                       and len(self.candidates(site)) == 2, f"gateway {site} holding both sites fresh",
                       deadline_s=deadline_s)
            wait_until(lambda site=site: self.get(site, readyz).status_code == 200,
                       f"gateway {site} ready", deadline_s=deadline_s)


def total(text: str, family: str, **labels: str) -> float:
    return sum(v for _, v in series(text, family, **labels))


# -- client load ----------------------------------------------------------------------------------


@dataclass
class Outcome:
    started: float  # monotonic
    elapsed: float
    status: int | None  # None: the client saw no HTTP answer (error text in ``error``)
    served_by: str | None = None
    retry_after: str | None = None
    error: str | None = None


class Load:
    """``workers`` client threads in ``site``'s namespace posting small chat completions to
    its gateway, one at a time each, until stopped (bounded by ``max_s`` and ``max_requests``).
    Each request has a client timeout of ``timeout_s``: an answer slower than that is a hang."""

    def __init__(self, grid: Grid, site: str, *, workers: int = 4, timeout_s: float = 15.0,
                 stream: bool = False, max_s: float = 120.0, max_requests: int = 20_000,
                 pause_s: float = 0.02) -> None:
        self.grid, self.site, self.workers, self.timeout_s = grid, site, workers, timeout_s
        self.stream, self.max_s, self.max_requests, self.pause_s = stream, max_s, max_requests, pause_s
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._worker, args=(i,), daemon=True)
                         for i in range(workers)]

    def __enter__(self) -> Load:
        self._t0 = time.monotonic()
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=self.timeout_s + 5)

    def _worker(self, i: int) -> None:
        body = {"model": MODEL, "max_tokens": 3, "stream": self.stream,
                "messages": [{"role": "user", "content": f"fault {self.site}{i}"}]}
        _setns(f"/var/run/netns/{self.grid.ns[self.site]}")  # this thread stays there
        with httpx.Client(base_url=f"http://127.0.0.1:{GW_HTTP}", timeout=self.timeout_s) as client:
            while not self._stop.is_set() and time.monotonic() - self._t0 < self.max_s:
                with self._lock:
                    if len(self.outcomes) >= self.max_requests:
                        return
                started = time.monotonic()
                try:
                    with client.stream("POST", "/v1/chat/completions", json=body) as r:
                        text = r.read().decode(errors="replace")
                        error = None
                        if r.status_code == 200 and self.stream and "data: [DONE]" not in text:
                            error = "stream ended without [DONE]"
                        out = Outcome(started, time.monotonic() - started, r.status_code,
                                      r.headers.get("x-gridd-served-by"), r.headers.get("retry-after"), error)
                except httpx.HTTPError as exc:
                    out = Outcome(started, time.monotonic() - started, None,
                                  error=f"{type(exc).__name__}: {exc}")
                with self._lock:
                    self.outcomes.append(out)
                time.sleep(self.pause_s)

    def since(self, t: float, until: float = float("inf")) -> list[Outcome]:
        with self._lock:
            return [o for o in self.outcomes if t <= o.started < until]

    def served_by(self, t: float, until: float = float("inf")) -> dict[str, int]:
        counts: dict[str, int] = {}
        for o in self.since(t, until):
            if o.status == 200:
                by = o.served_by or "-"  # a 200 without x-gridd-served-by
                counts[by] = counts.get(by, 0) + 1
        return counts

    def wrong(self) -> list[Outcome]:
        """Every answer that is neither a 200 nor a designed 429/503 with Retry-After, or came
        later than the client's bound."""
        with self._lock:
            return [o for o in self.outcomes
                    if not ((o.status == 200 and o.error is None)
                            or (o.status in (429, 503) and o.retry_after))]


def free_port_in(netns: str) -> int:
    with inside(netns), socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_signal(grid: Grid, gateway_site: str, site: str, signal: str, since: float, bound_s: float) -> float:
    """Wait until gateway ``gateway_site`` holds ``site``'s candidate in ``signal`` state;
    the seconds since ``since``, asserted within ``bound_s``."""
    wait_until(lambda: grid.candidates(gateway_site)[site]["signal"] == signal,
               f"gateway {gateway_site} holding {site} {signal}", deadline_s=bound_s + 5)
    elapsed = time.monotonic() - since
    assert elapsed <= bound_s, \
        f"gateway {gateway_site} saw {site} {signal} after {elapsed:.1f} s > {bound_s} s"
    return elapsed


class DelayProxy:
    """A TCP proxy in namespace ``netns`` (127.0.0.1, a free port) to ``target``; every chunk
    reaches the other side ``delay_s`` after it was read (a slow link: latency, not a
    throughput cap). ``delay_s`` may change while it runs. Threads, all joined by ``close``."""

    def __init__(self, netns: str, target: tuple[str, int]) -> None:
        self.netns, self.target, self.delay_s = netns, target, 0.0
        self.port = free_port_in(netns)
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []
        self._socks: list[socket.socket] = []
        self._listener: socket.socket | None = None
        ready = threading.Event()
        self._spawn(self._accept_loop, ready)
        ready.wait(10)

    def _spawn(self, target, *args) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(t)
        t.start()

    def _accept_loop(self, ready: threading.Event) -> None:
        _setns(f"/var/run/netns/{self.netns}")
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._listener.settimeout(0.2)
        ready.set()
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            self._socks += [client, upstream]
            self._spawn(self._pump, client, upstream)
            self._spawn(self._pump, upstream, client)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        import queue

        chunks: queue.Queue = queue.Queue()

        def sender() -> None:
            while True:
                due, data = chunks.get()
                if data is None:
                    break
                time.sleep(max(0.0, due - time.monotonic()))
                try:
                    dst.sendall(data)
                except OSError:
                    break
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

        self._spawn(sender)
        src.settimeout(0.5)
        while not self._closed.is_set():
            try:
                data = src.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data:
                break
            chunks.put((time.monotonic() + self.delay_s, data))
        chunks.put((0.0, None))

    def close(self) -> None:
        self._closed.set()
        for s in [*self._socks, *([self._listener] if self._listener else [])]:
            with contextlib.suppress(OSError):
                s.close()
        for t in self._threads:
            t.join(timeout=5)
