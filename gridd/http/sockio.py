"""Reads and writes on a non-blocking socket that wait in trio only when the kernel has
nothing to give (the HTTP clients' plain connections: the scrape client and the forwarding
client).

trio's SocketStream tries every read before waiting (after a request is sent, one wasted
EAGAIN and one more wait) and passes through the scheduler after every call that returned at
once; a client that sends a request and then waits for its answer needs neither. These
functions checkpoint only when they wait, so a caller looping over them must wait somewhere
(a client always waits for the next answer). OSError (a reset, a broken pipe) passes through:
each caller maps it at its own edge (STYLE 4).
"""

from __future__ import annotations

import socket

import trio

__all__ = ["receive", "receive_into", "send_all"]


async def send_all(sock: socket.socket, data: bytes) -> bool:
    """Write all of ``data``, waiting for room only when the kernel's buffer is full; whether
    it waited (a caller counting calls that returned at once needs to know)."""
    view = memoryview(data)
    sent = 0
    waited = False
    while True:
        try:
            sent += sock.send(view[sent:] if sent else view)
        except BlockingIOError:
            pass
        if sent >= len(view):
            return waited
        await trio.lowlevel.wait_writable(sock)
        waited = True


async def receive(sock: socket.socket, max_bytes: int, *, wait_first: bool) -> bytes:
    """The bytes waiting (at most ``max_bytes``), else the next that arrive; b"" at EOF.
    ``wait_first``: nothing can be waiting yet (a request was just sent), so wait before
    reading instead of trying a read that would fail."""
    if wait_first:
        await trio.lowlevel.wait_readable(sock)
    while True:
        try:
            return sock.recv(max_bytes)
        except BlockingIOError:
            await trio.lowlevel.wait_readable(sock)


async def receive_into(sock: socket.socket, into: memoryview, *, wait_first: bool) -> int:
    """As ``receive``, into ``into``; how many bytes were read (0 at EOF)."""
    if wait_first:
        await trio.lowlevel.wait_readable(sock)
    while True:
        try:
            return sock.recv_into(into)
        except BlockingIOError:
            await trio.lowlevel.wait_readable(sock)
