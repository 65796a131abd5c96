"""Child processes that ``gridd demo``, the benchmarks and the tests start: free loopback ports
to give them, and the one way they are stopped. A running gridd daemon uses none of this."""

from __future__ import annotations

import signal
import socket
import subprocess
from collections.abc import Iterable


def free_ports(n: int) -> list[int]:
    """n distinct free ports on 127.0.0.1, held together while chosen so that they differ
    (free when chosen: the child that gets one binds it soon after)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def stop_processes(procs: Iterable[subprocess.Popen], *, grace_s: float) -> None:
    """SIGTERM every process still running, all at once; then wait up to ``grace_s`` for each
    in turn, and SIGKILL (and reap, waiting as long again) any that has not exited by then."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=grace_s)
