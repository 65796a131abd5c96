"""The control socket: gridctl talks to a running gridd over a local unix socket.

Protocol: the client sends one JSON object on one line (``{"cmd": "status"}``), the server
answers one JSON object on one line and closes. The socket file is mode 0660 so an
operators' group can use gridctl without root.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pathlib
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from gridd.errors import ControlError

log = logging.getLogger("gridd.control")

MAX_REQUEST_BYTES = 64 * 1024
REQUEST_DEADLINE_S = 5.0
"""A client gets this long to send its request line; a reload answer may take longer."""

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


def _claim_socket_path(path: pathlib.Path) -> None:
    """Remove a stale socket left by a dead daemon; refuse if a live daemon answers on it."""
    if not path.exists() and not path.is_symlink():
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink(missing_ok=True)
        return
    finally:
        probe.close()
    raise ControlError(f"{path}: another gridd is already listening on this control socket")


async def open_control_listener(path: pathlib.Path) -> trio.SocketListener:
    await trio.to_thread.run_sync(lambda: path.parent.mkdir(parents=True, exist_ok=True))
    await trio.to_thread.run_sync(_claim_socket_path, path)
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        await sock.bind(str(path))
        os.chmod(path, 0o660)
        sock.listen(16)
    except OSError as exc:
        sock.close()
        raise ControlError(f"{path}: cannot listen on control socket: {exc.strerror or exc}") from None
    return trio.SocketListener(sock)


async def _read_line(stream: trio.abc.ReceiveStream) -> bytes:
    buf = bytearray()
    while b"\n" not in buf:
        chunk = await stream.receive_some(4096)
        if not chunk:
            break
        buf += chunk
        if len(buf) > MAX_REQUEST_BYTES:
            raise ValueError(f"request longer than {MAX_REQUEST_BYTES} bytes")
    return bytes(buf).split(b"\n", 1)[0]


async def serve_control(
    path: pathlib.Path, handler: Handler, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    listener = await open_control_listener(path)

    async def connection(stream: trio.SocketStream) -> None:
        async with stream:
            reply: dict[str, Any]
            try:
                with trio.fail_after(REQUEST_DEADLINE_S):
                    line = await _read_line(stream)
                request = json.loads(line)
                if not isinstance(request, dict) or not isinstance(request.get("cmd"), str):
                    raise ValueError('expected a JSON object with a "cmd" string')
                reply = await handler(request)
            except trio.TooSlowError:
                reply = {"ok": False, "error": "request not received in time"}
            except (ValueError, UnicodeDecodeError, RecursionError) as exc:
                reply = {"ok": False, "error": f"bad request: {type(exc).__name__}: {exc}"[:300]}
            except Exception as exc:  # one bad request must never take the daemon down
                log.exception("control request failed")
                reply = {"ok": False, "error": f"internal error: {exc!r}"[:300]}
            with trio.move_on_after(REQUEST_DEADLINE_S):  # a client that stops reading
                try:
                    await stream.send_all(json.dumps(reply, default=str).encode() + b"\n")
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass

    try:
        async with trio.open_nursery() as nursery:
            task_status.started()
            await trio.serve_listeners(connection, [listener], handler_nursery=nursery)
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(lambda: path.unlink(missing_ok=True))


def request(path: pathlib.Path, cmd: str, *, timeout_s: float = 30.0, **args: Any) -> dict[str, Any]:
    """Blocking client for gridctl: one request, one reply."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        try:
            sock.connect(str(path))
        except FileNotFoundError:
            raise ControlError(f"{path}: no control socket (is gridd running? see --socket)") from None
        except OSError as exc:
            if exc.errno in (errno.ECONNREFUSED, errno.ENOTSOCK):
                raise ControlError(f"{path}: control socket is dead (gridd not running)") from None
            raise ControlError(f"{path}: cannot connect: {exc.strerror or exc}") from None
        sock.sendall(json.dumps({"cmd": cmd, **args}).encode() + b"\n")
        buf = bytearray()
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            buf += chunk
    except TimeoutError:
        raise ControlError(f"{path}: gridd did not answer within {timeout_s:g} s") from None
    except OSError as exc:
        raise ControlError(f"{path}: {exc.strerror or exc}") from None
    finally:
        sock.close()
    try:
        reply = json.loads(buf)
    except ValueError:
        raise ControlError(f"{path}: unreadable answer from gridd") from None
    if not isinstance(reply, dict):
        raise ControlError(f"{path}: unreadable answer from gridd")
    return reply
