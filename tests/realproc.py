"""Helpers shared by the tests that start real gridd processes on loopback."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (held together while chosen, so they differ)."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


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


def gridctl(sock, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """Run gridctl against the control socket ``sock`` (the installed console script's code)."""
    return subprocess.run([sys.executable, "-c", "from gridd.cli import gridctl_main; raise SystemExit(gridctl_main())",
                           "--socket", str(sock), *args], capture_output=True, text=True, timeout=30, input=stdin)


def gridctl_status(sock) -> dict | None:
    out = gridctl(sock, "status", "--json")
    return json.loads(out.stdout)["status"] if out.returncode == 0 else None


def start_gridd(*args: str, env: dict[str, str] | None = None, stderr=subprocess.DEVNULL) -> subprocess.Popen:
    """`python -m gridd ARGS` as a child process (stderr: DEVNULL, or PIPE to read it)."""
    return subprocess.Popen([sys.executable, "-m", "gridd", *args], stderr=stderr,
                            text=stderr is subprocess.PIPE, env=env if env is not None else dict(os.environ))


def stop(procs) -> None:
    """SIGTERM every process still running, then wait (10 s each) or kill."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
