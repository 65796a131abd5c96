"""Serving gridd's ASGI apps (simulator, providers API, OpenAI front, /metrics).

serve_asgi(app, binds, *, task_status) serves until cancelled; task_status.started()
receives the bound addresses as "http://host:port" strings, so port 0 works in tests.
"""

from __future__ import annotations

import trio
from hypercorn.config import Config
from hypercorn.trio import serve


async def serve_asgi(app, binds: list[str], *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    config = Config()
    config.bind = list(binds)
    config.accesslog = None
    config.errorlog = None
    await serve(app, config, task_status=task_status)
