"""The daemon: builds the nursery tree of DESIGN.md section 4 for its role.

gridd (root)
├── signals: SIGHUP -> staged reload (coalesced), SIGTERM/SIGINT -> drain then exit
├── control socket, metrics listener        (nursery.start: READY=1 only after all of them)
├── reload worker, systemd watchdog pings (if WATCHDOG_USEC)
└── role service (operator | gateway), drained with a deadline on shutdown
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import time
from typing import Any

import prometheus_client
import trio
from prometheus_client import CollectorRegistry, Counter, Gauge

from gridd import __version__
from gridd.config import LoadedConfig, default_control_socket, load_config
from gridd.control import serve_control
from gridd.errors import GriddError
from gridd.http.serve import serve_asgi
from gridd.link.periodic import run_periodic
from gridd.metrics_app import make_metrics_app
from gridd.notify import Notifier
from gridd.preflight import check_listen
from gridd.reload_plan import plan_reload
from gridd.roles import AttachesReload, ClearsGatewayEvidence, ExplainsRouting, RoleService

log = logging.getLogger("gridd.daemon")

# gridd's counters need no *_created twins; they only double every counter's series.
prometheus_client.disable_created_metrics()


def build_role(loaded: LoadedConfig, registry: CollectorRegistry) -> RoleService:
    if loaded.config.role == "operator":
        from gridd.operator.service import OperatorService

        return OperatorService(loaded, registry)
    from gridd.gateway.service import GatewayService

    return GatewayService(loaded, registry)


DAEMON_STATES = ("starting", "serving", "degraded", "draining")
"""The daemon's state in gridctl status (docs/troubleshooting.md, "Status states")."""

class Daemon:
    def __init__(
        self,
        loaded: LoadedConfig,
        *,
        notifier: Notifier | None = None,
        registry: CollectorRegistry | None = None,
        env: dict[str, str] | None = None,
        role: RoleService | None = None,
    ) -> None:
        self.loaded = loaded
        self.notifier = notifier or Notifier(env)
        self.registry = registry or CollectorRegistry()
        self.env = dict(os.environ) if env is None else env
        self.role = role or build_role(loaded, self.registry)
        if isinstance(self.role, AttachesReload):
            # The operator's providers API persists through the same staged reload as SIGHUP.
            self.role.attach_reload(self.reload)
        self.started_wall = time.time()
        self.started_mono = time.monotonic()
        self.control_path = default_control_socket(loaded.config, loaded.workspace, self.env)
        self.metrics_urls: list[str] = []
        self.last_reload: dict[str, Any] = {"result": "none", "at": None, "error": None, "source": None}
        self._reload_lock = trio.Lock()
        self._reload_wanted = trio.Event()
        self._stop_requested = trio.Event()
        self._draining = False
        self._started = False
        self._reloads = Counter(
            "gridd_config_reloads", "Staged config reloads by result.", ["result"], registry=self.registry
        )
        for result in ("ok", "error"):
            self._reloads.labels(result)
        info = Gauge("gridd_info", "gridd build and role.", ["version", "role", "site"],
                     registry=self.registry)
        info.labels(__version__, loaded.config.role, loaded.config.site).set(1)
        Gauge("gridd_start_time_seconds", "Wall-clock start time of the process.",
              registry=self.registry).set(self.started_wall)

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await self._run(task_status=task_status)
        except BaseExceptionGroup as group:
            # A start-up failure (socket in use, bad TLS files) reaches the caller as the plain
            # GriddError it is, so `gridd run` can print one clear line.
            errors = group.exceptions
            if len(errors) == 1 and isinstance(errors[0], GriddError):
                raise errors[0] from None
            raise

    async def _run(self, *, task_status: trio.TaskStatus[None]) -> None:
        cfg = self.loaded.config
        check_listen(cfg)  # a listen address no server can bind: one clear line, nothing started
        async with trio.open_nursery() as root:
            await root.start(self._signal_loop, name="signals")
            await root.start(serve_control, self.control_path, self._handle_control, name="control-socket")
            if cfg.listen.metrics:
                self.metrics_urls = await root.start(
                    serve_asgi, make_metrics_app(self.registry), [cfg.listen.metrics], name="metrics-listener"
                )
            await root.start(self._run_role, name=f"{cfg.role}-service")
            root.start_soon(self._reload_worker, name="reload-worker")
            if self.notifier.watchdog_interval_s is not None:
                root.start_soon(self._watchdog, self.notifier.watchdog_interval_s, name="watchdog")
            # STYLE 5: every server above called started() only once it could serve.
            self._started = True
            self.notifier.ready()
            log.info("ready: role=%s site=%s config=%s control=%s", cfg.role, cfg.site,
                     self.loaded.path, self.control_path)
            task_status.started()
            await self._stop_requested.wait()
            await self._drain()
            root.cancel_scope.cancel()
        log.info("stopped")

    async def _run_role(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await self.role.run(task_status=task_status)

    async def _drain(self) -> None:
        """STYLE 6: stop producers, give in-flight work a bounded grace period."""
        self._draining = True
        grace = self.loaded.config.drain_grace_s
        self.notifier.stopping()
        log.info("draining for at most %g s", grace)
        with trio.move_on_after(grace) as scope:
            await self.role.drain()
        if scope.cancelled_caught:
            log.warning("drain deadline of %g s reached; cancelling what is left", grace)

    def request_stop(self) -> None:
        self._stop_requested.set()

    async def _signal_loop(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with trio.open_signal_receiver(signal.SIGHUP, signal.SIGTERM, signal.SIGINT) as signals:
            task_status.started()
            async for signum in signals:
                if signum == signal.SIGHUP:
                    self._reload_wanted.set()  # coalesced: many HUPs, one reload
                elif self._stop_requested.is_set():
                    log.warning("second %s during drain: stopping now", signal.Signals(signum).name)
                    raise KeyboardInterrupt
                else:
                    log.info("%s received: shutting down", signal.Signals(signum).name)
                    self._stop_requested.set()

    async def _reload_worker(self) -> None:
        while True:
            await self._reload_wanted.wait()
            self._reload_wanted = trio.Event()
            await self.reload(source="SIGHUP")

    async def _watchdog(self, interval_s: float) -> None:
        # The shared periodic loop (gridd/link/periodic.py): drift-free, one ping per interval.
        async def ping() -> None:
            self.notifier.watchdog()

        await run_periodic(lambda: interval_s, ping)

    # -- staged reload -----------------------------------------------------------------------

    async def reload(self, *, source: str) -> dict[str, Any]:
        """Decode and validate, stage role-specific checks, and only then commit. A rejected
        reload changes and publishes nothing and keeps serving the old config."""
        if not self._started or self._draining:
            # Before READY=1 the role is still building its state from this very file; while
            # draining a reload would tell systemd READY=1 after STOPPING=1. Neither is useful.
            state = "still starting" if not self._started else "draining"
            log.warning("reload (%s) refused: gridd is %s", source, state)
            return {"result": "error", "error": f"gridd is {state}; reload refused", "at": time.time(),
                    "source": source}
        async with self._reload_lock:
            self.notifier.reloading()
            try:
                new = await trio.to_thread.run_sync(
                    functools.partial(load_config, self.loaded.path, env=self.env))
                # What the daemon itself holds (gridd.reload_plan); the role checks its own.
                plan = plan_reload(self.loaded.config, new.config)
                plan.refuse_restart_changes("daemon", config_file=str(self.loaded.path))
                staged = await self.role.stage(new)
                self.role.commit(staged)
                self.loaded = new
                logging.getLogger().setLevel(new.config.log_level.upper())
                result: dict[str, Any] = {"result": "ok", "error": None}
                log.info("reload (%s) committed: %s", source, new.path)
            except GriddError as exc:
                result = {"result": "error", "error": str(exc)}
                log.error("reload (%s) rejected, keeping the running config: %s", source, exc)
            except Exception as exc:  # a bug in staging must not take the serving daemon down
                result = {"result": "error", "error": f"internal error: {exc!r}"}
                log.exception("reload (%s) failed unexpectedly, keeping the running config", source)
            finally:
                self.notifier.ready("serving")
            self._reloads.labels(result["result"]).inc()
            self.last_reload = {**result, "at": time.time(), "source": source}
            return dict(self.last_reload)

    # -- control socket ----------------------------------------------------------------------

    async def _handle_control(self, request: dict[str, Any]) -> dict[str, Any]:
        cmd = request["cmd"]
        if cmd == "status":
            return {"ok": True, "status": self.status()}
        if cmd == "reload":
            outcome = await self.reload(source="gridctl")
            return {"ok": outcome["result"] == "ok", "reload": outcome}
        if cmd == "clear-feedback":
            if not isinstance(self.role, ClearsGatewayEvidence):
                return {"ok": False, "error": "clear-feedback is an operator command"}
            replica = request.get("replica")
            if replica is not None and not isinstance(replica, str):
                return {"ok": False, "error": "replica must be a string"}
            try:
                cleared = await self.role.clear_gateway_evidence(replica)
            except GriddError as exc:
                return {"ok": False, "error": str(exc)}
            return {"ok": True, "cleared": cleared}
        if cmd == "explain":
            if not isinstance(self.role, ExplainsRouting):
                return {"ok": False, "error": "explain is a gateway command (this gridd runs as "
                                              f"{self.loaded.config.role}); "
                                              "run it against a gateway's socket"}
            model = request.get("model")
            if not isinstance(model, str) or not model:
                return {"ok": False, "error": "explain needs a model name"}
            return {"ok": True, "explain": self.role.explain(model)}
        return {"ok": False, "error": f"unknown command {cmd!r} (status, reload, clear-feedback, explain)"}

    def status(self) -> dict[str, Any]:
        cfg = self.loaded.config
        role_status = self.role.status()
        # The control socket answers from the start: "starting" until READY=1; "degraded"
        # while serving without something the role needs (role_status["degraded"] says what).
        if self._draining:
            state = "draining"
        elif not self._started:
            state = "starting"
        else:
            state = "degraded" if role_status.get("degraded") else "serving"
        return {
            "role": cfg.role,
            "site": cfg.site,
            "version": __version__,
            "pid": os.getpid(),
            "uptime_s": round(time.monotonic() - self.started_mono, 3),
            "state": state,
            "config_file": str(self.loaded.path),
            "config_loaded_at": self.loaded.loaded_at,
            "last_reload": self.last_reload,
            "metrics": self.metrics_urls,
            "tasks": running_task_names(),
            "role_status": role_status,
        }


def running_task_names() -> list[str]:
    """Names of the live tasks under the root task, from trio's own task tree."""
    names: list[str] = []

    def walk(task: trio.lowlevel.Task, depth: int) -> None:
        for nursery in task.child_nurseries:
            for child in nursery.child_tasks:
                # gridd names its tasks plainly ("signals"); library internals are dotted.
                if "." not in child.name and not child.name.startswith("<"):
                    names.append(child.name)
                if depth < 6:
                    walk(child, depth + 1)

    root = trio.lowlevel.current_root_task()
    if root is not None:  # None only outside trio.run
        walk(root, 0)
    return sorted(set(names))
