"""Restartable, scoped tasks keyed by peer (STYLE 7).

One supervisor owns one nursery; each task runs under its own cancel scope in a map keyed
by what it serves (a peer's (site, url), the gateway's one operator), so one task can be
stopped or restarted without touching the others. A task whose body ends (returns, or
raises an Exception: a bug) is logged and started again after ``restart_delay_s()``, so
a bug in one peer's task neither stops the others nor spins.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

import trio

__all__ = ["TaskSupervisor"]

K = TypeVar("K", bound=Hashable)

Body = Callable[[], Awaitable[object]]


class _Task:
    __slots__ = ("body", "label", "scope")

    def __init__(self, body: Body, label: str) -> None:
        self.body = body
        self.label = label
        self.scope = trio.CancelScope()


class TaskSupervisor(Generic[K]):
    """Tasks keyed by K. ``run`` hosts them; ``start``/``stop``/``restart`` change them."""

    def __init__(self, *, restart_delay_s: Callable[[], float], log: logging.Logger) -> None:
        self.restart_delay_s = restart_delay_s
        self.log = log
        self._tasks: dict[K, _Task] = {}
        self._nursery: trio.Nursery | None = None
        self._restarts = 0

    @property
    def running(self) -> bool:
        return self._nursery is not None

    @property
    def restarts(self) -> int:
        """How many tasks ``restart`` replaced (for status and tests)."""
        return self._restarts

    def keys(self) -> list[K]:
        return list(self._tasks)

    def __contains__(self, key: K) -> bool:
        return key in self._tasks

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Host the tasks until cancelled; they are cancelled with it."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                task_status.started()
                await trio.sleep_forever()
            finally:
                self._nursery = None
                self._tasks.clear()

    def start(self, key: K, body: Body, *, label: str) -> trio.CancelScope:
        """Run ``body`` as the task of ``key`` (replacing a running one); returns the task's
        cancel scope. ``label`` names it in logs ("<label> failed; restarting it")."""
        if self._nursery is None:
            raise RuntimeError("TaskSupervisor.start() before run()")
        self.stop(key)
        task = self._tasks[key] = _Task(body, label)
        self._nursery.start_soon(self._supervise, task, name=label)
        return task.scope

    def stop(self, key: K) -> bool:
        """Cancel the task of ``key``; False if there was none."""
        task = self._tasks.pop(key, None)
        if task is None:
            return False
        task.scope.cancel()
        return True

    def restart(self, key: K) -> bool:
        """Cancel the task of ``key`` and start its body again at once; False if none."""
        task = self._tasks.get(key)
        if task is None:
            return False
        self._restarts += 1
        self.start(key, task.body, label=task.label)
        return True

    async def _supervise(self, task: _Task) -> None:
        with task.scope:
            while True:
                try:
                    await task.body()
                except Exception:
                    # A bug in one task must not stop the others; it starts over.
                    self.log.exception("%s failed; restarting it", task.label)
                await trio.sleep(self.restart_delay_s())
