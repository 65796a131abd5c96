"""systemd notify protocol (sd_notify) with the stdlib: READY, RELOADING, STOPPING, WATCHDOG.

A no-op when $NOTIFY_SOCKET is unset (not started by systemd). Datagrams are tiny and the
socket is local, so a send never blocks the trio loop in practice.
"""

from __future__ import annotations

import logging
import os
import socket
import time

log = logging.getLogger("gridd.notify")


class Notifier:
    def __init__(self, env: dict[str, str] | None = None) -> None:
        env = dict(os.environ) if env is None else env
        addr = env.get("NOTIFY_SOCKET", "")
        if addr.startswith("@"):
            addr = "\0" + addr[1:]  # abstract namespace
        self._addr = addr or None
        self._sock: socket.socket | None = None
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        wanted = usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid()))
        self.watchdog_interval_s: float | None = int(usec) / 1e6 / 2 if wanted else None
        """systemd's advice: ping at half of WATCHDOG_USEC."""

    @property
    def enabled(self) -> bool:
        return self._addr is not None

    def send(self, *fields: str) -> None:
        if self._addr is None:
            return
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto("\n".join(fields).encode(), self._addr)
        except OSError as exc:
            log.warning("cannot notify systemd at %s: %s", self._addr, exc)

    def ready(self, status: str = "serving") -> None:
        self.send("READY=1", f"STATUS={status}")

    def reloading(self) -> None:
        # Type=notify-reload wants MONOTONIC_USEC beside RELOADING=1.
        self.send("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")

    def stopping(self) -> None:
        self.send("STOPPING=1", "STATUS=draining")

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
