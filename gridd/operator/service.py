"""The operator role: scrape pool, exporter, signals server, peer pollers (see DESIGN.md 4)."""

from __future__ import annotations

from typing import Any

import trio
from prometheus_client import CollectorRegistry

from gridd.config import LoadedConfig


class OperatorService:
    def __init__(self, loaded: LoadedConfig, registry: CollectorRegistry) -> None:
        self.loaded = loaded
        self.registry = registry

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await trio.sleep_forever()

    async def stage(self, new: LoadedConfig) -> LoadedConfig:
        return new

    def commit(self, staged: LoadedConfig) -> None:
        self.loaded = staged

    async def drain(self) -> None:
        return None

    def status(self) -> dict[str, Any]:
        return {"providers": [p.name for p in self.loaded.config.providers]}
