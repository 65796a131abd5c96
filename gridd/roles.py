"""What the daemon needs from a role (operator or gateway).

Every role (``RoleService``):

run():    start the role's servers and tasks; call task_status.started() only when it can
          serve (STYLE 5), then run until cancelled.
stage():  check a new config beyond decoding (TLS material, addresses, and the settings it
          holds that need a restart: gridd.reload_plan); raise GriddError to reject it. Must
          change nothing.
commit(): swap the staged config in; pollers whose peer changed restart under their own
          cancel scope, shared state is never rebuilt.
drain():  stop producers and let in-flight work finish; the daemon bounds it with a deadline.
status(): role-specific facts for gridctl.

Abilities only one role has are protocols of their own, which the daemon checks with
isinstance: ``AttachesReload`` and ``ClearsGatewayEvidence`` (the operator),
``ExplainsRouting`` (the gateway). A control command for an ability the role lacks is
answered with an error naming the role that has it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping
from typing import Any, Protocol, runtime_checkable

import trio

from gridd.config import LoadedConfig


class RoleService(Protocol):
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None: ...

    async def stage(self, new: LoadedConfig) -> Any: ...

    def commit(self, staged: Any) -> None: ...

    async def drain(self) -> None: ...

    def status(self) -> dict[str, Any]: ...


class StagedReload(Protocol):
    """The daemon's staged reload (``Daemon.reload``), the one SIGHUP runs: its answer is the
    control socket's ``reload`` object (``result``, ``error``, ``at``, ``source``)."""

    def __call__(self, *, source: str) -> Awaitable[Mapping[str, Any]]: ...


@runtime_checkable
class AttachesReload(Protocol):
    """A role whose own requests change the config file (the operator's providers API): its
    writes go through the daemon's staged reload, which the daemon attaches at start."""

    def attach_reload(self, reload: StagedReload) -> None: ...


@runtime_checkable
class ClearsGatewayEvidence(Protocol):
    """``gridctl clear-feedback [REPLICA]`` (the operator): resolve GatewayAgesRejected for one
    replica, or all (None); the replicas cleared. GriddError when it cannot be stored."""

    async def clear_gateway_evidence(self, replica: str | None) -> list[str]: ...


@runtime_checkable
class ExplainsRouting(Protocol):
    """``gridctl explain MODEL`` (the gateway): the routing view of one model."""

    def explain(self, model: str) -> dict[str, Any]: ...
