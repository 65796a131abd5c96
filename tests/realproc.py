"""Helpers shared by the tests that start real gridd processes on loopback."""

from __future__ import annotations

import socket
import subprocess
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


def stop(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within grace_s."""
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=grace_s)
