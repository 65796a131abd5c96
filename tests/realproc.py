"""Helpers shared by the tests that start real gridd processes on loopback."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from gridd.childprocs import stop_processes

# An operator of ``site`` with mutual TLS from ``{certs}/`` (made by ``gridd certs``), its
# metrics and signals listeners on loopback, run and state directories of its own.
PEERED_OPERATOR = """
role: operator
site: {site}
trust_domain: grid.local
tls: {{ca: {certs}/ca.pem, cert: {certs}/{site}-operator.pem, key: {certs}/{site}-operator-key.pem}}
listen: {{metrics: "127.0.0.1:{metrics}", signals: "127.0.0.1:{signals}"}}
control_socket: run/{site}.sock
state_dir: state/{site}
drain_grace_s: 2
providers:
{providers}
peers:
{peers}
timings: {timings}
"""


def series(text: str, family: str, **labels: str) -> list[tuple[dict[str, str], float]]:
    """Samples of ``family`` in a Prometheus exposition whose labels include ``labels``."""
    found = []
    for m in re.finditer(rf"^{family}(?:\{{([^}}]*)\}})? (\S+)", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            found.append((have, float(m.group(2))))
    return found


def wait_until(check, what: str, deadline_s: float = 30.0):
    """Poll ``check`` until it returns something truthy (returned), bounded by deadline_s.
    HTTP, OS and ValueError failures count as "not yet"."""
    end = time.monotonic() + deadline_s
    last = None
    while time.monotonic() < end:
        try:
            last = check()
            if last:
                return last
        except (httpx.HTTPError, OSError, ValueError) as exc:
            last = exc
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}: {last!r}")


class Processes:
    """Named gridd processes started in one directory, each logging to ``<name>.log``
    there; ``env`` adds variables to a process's environment. As a context manager it
    stops them all on the way out, and prints each one's log first when the test failed."""

    LOG_TAIL_CHARS = 4000

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.procs: dict[str, subprocess.Popen] = {}

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is not None:
                for log in sorted(self.dir.glob("*.log")):
                    print(f"--- {log.name}\n{log.read_text(errors='replace')[-self.LOG_TAIL_CHARS:]}")
        finally:
            self.stop_all()

    def start(self, name: str, *args: str, env: dict[str, str] | None = None,
              prefix: tuple[str, ...] = ()) -> subprocess.Popen:
        """``prefix`` goes before the command, e.g. ``ip netns exec NS`` (which execs it, so
        the pid is gridd's own)."""
        log = open(self.dir / f"{name}.log", "ab")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen([*prefix, sys.executable, "-m", "gridd", *args], stdout=log, stderr=log,
                                cwd=self.dir, env=None if env is None else {**os.environ, **env})
        log.close()
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.dir / f"{name}.log").read_text(errors="replace")

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.kill()
        proc.wait(timeout=10)

    def stop(self, name: str) -> int:
        """SIGTERM one process and wait for it; its exit code."""
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout=20)

    def stop_all(self) -> None:
        stop_processes(self.procs.values(), grace_s=10)

    def sim_url(self, name: str) -> str:
        def url() -> str | None:
            m = re.search(r"listening on (http://\S+)", self.log(name))
            return m.group(1) if m else None

        return wait_until(url, f"{name} to listen")


def gridctl(sock, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """Run gridctl against the control socket ``sock`` (the installed console script's code)."""
    return subprocess.run([sys.executable, "-c",
                           "from gridd.cli import gridctl_main; raise SystemExit(gridctl_main())",
                           "--socket", str(sock), *args], capture_output=True, text=True, timeout=30,
                          input=stdin)


def gridctl_status(sock) -> dict | None:
    out = gridctl(sock, "status", "--json")
    return json.loads(out.stdout)["status"] if out.returncode == 0 else None


def start_gridd(*args: str, env: dict[str, str] | None = None, stderr=subprocess.DEVNULL) -> subprocess.Popen:
    """`python -m gridd ARGS` as a child process (stderr: DEVNULL, or PIPE to read it)."""
    return subprocess.Popen([sys.executable, "-m", "gridd", *args], stderr=stderr,
                            text=stderr is subprocess.PIPE, env=env if env is not None else dict(os.environ))

