"""What the daemon needs from a role (operator or gateway).

run():    start the role's servers and tasks; call task_status.started() only when it can
          serve (STYLE 5), then run until cancelled.
stage():  check a new config beyond decoding (TLS material, addresses); raise GriddError to
          reject it. Must change nothing.
commit(): swap the staged config in; pollers whose peer changed restart under their own
          cancel scope, shared state is never rebuilt.
drain():  stop producers and let in-flight work finish; the daemon bounds it with a deadline.
status(): role-specific facts for gridctl.
"""

from __future__ import annotations

from typing import Any, Protocol

import trio

from gridd.config import LoadedConfig


class RoleService(Protocol):
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None: ...

    async def stage(self, new: LoadedConfig) -> Any: ...

    def commit(self, staged: Any) -> None: ...

    async def drain(self) -> None: ...

    def status(self) -> dict[str, Any]: ...
