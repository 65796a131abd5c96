"""The pure core: bytes and structs in, structs out, time passed in as ``now``.

Nothing under this package imports trio, httpx, hypercorn or trio_websocket; the
trio tasks in gridd.operator / gridd.gateway only move data into and out of it.
"""
