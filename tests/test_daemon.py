"""The daemon's nursery tree: READY only after every server, staged reload, drain deadline,
systemd notify messages on a fake NOTIFY_SOCKET, the control socket and gridctl."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys

import pytest
import trio

from gridd import control
from gridd.config import load_config
from gridd.daemon import Daemon
from gridd.errors import ControlError, GriddError
from gridd.gateway.service import GatewayService
from gridd.notify import Notifier
from gridd.operator.service import OperatorService
from gridd.roles import AttachesReload, ClearsGatewayEvidence, ExplainsRouting

OPERATOR = """
role: operator
site: a
control_socket: run/gridd.sock
state_dir: var/state
drain_grace_s: 10
listen: {{metrics: "127.0.0.1:0"}}
providers:
  - name: {name}
    model: m
    settings: {{endpoint: "http://127.0.0.1:9/v1"}}
"""


class FakeRole:
    """A role whose drain can be made to hang, and whose staging can be made to fail."""

    def __init__(self) -> None:
        self.drain_forever = False
        self.drained = False
        self.reject_next: str | None = None
        self.committed: list[str] = []

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED):
        task_status.started()
        await trio.sleep_forever()

    async def stage(self, new):
        if self.reject_next:
            raise GriddError(self.reject_next)
        return new

    def commit(self, staged):
        self.committed.append(staged.config.providers[0].name)

    async def drain(self):
        if self.drain_forever:
            await trio.sleep_forever()
        self.drained = True

    def status(self):
        return {"fake": True}


class NotifySink:
    """A unix datagram socket standing in for systemd's NOTIFY_SOCKET."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        self.sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

    async def bind(self) -> None:
        await self.sock.bind(str(self.path))

    async def next(self) -> list[str]:
        data = await self.sock.recv(4096)
        return data.decode().split("\n")


@pytest.fixture
def workspace(tmp_path):
    (tmp_path / "gridd.yaml").write_text(OPERATOR.format(name="first"))
    return tmp_path


async def _request(path, cmd, **args):
    return await trio.to_thread.run_sync(lambda: control.request(path, cmd, **args))


class AbleRole(FakeRole):
    """A role with every optional ability the daemon knows (gridd.roles)."""

    def __init__(self) -> None:
        super().__init__()
        self.reload = None
        self.cleared: list[str | None] = []

    def attach_reload(self, reload):
        self.reload = reload

    async def clear_gateway_evidence(self, replica):
        self.cleared.append(replica)
        return ["g1"] if replica is None else [replica]

    def explain(self, model):
        return {"model": model}


def test_each_role_declares_the_abilities_the_daemon_uses():
    assert issubclass(OperatorService, AttachesReload) and issubclass(OperatorService, ClearsGatewayEvidence)
    assert not issubclass(OperatorService, ExplainsRouting)
    assert issubclass(GatewayService, ExplainsRouting)
    assert not issubclass(GatewayService, AttachesReload | ClearsGatewayEvidence)


@pytest.mark.parametrize("able", [False, True])
async def test_control_commands_reach_only_the_abilities_a_role_declares(workspace, able):
    loaded = load_config(workspace / "gridd.yaml", env={})
    role = AbleRole() if able else FakeRole()
    daemon = Daemon(loaded, env={}, role=role)
    async with trio.open_nursery() as nursery:
        await nursery.start(daemon.run)
        clear = await _request(daemon.control_path, "clear-feedback", replica="g2")
        bad_replica = await _request(daemon.control_path, "clear-feedback", replica=7)
        explain = await _request(daemon.control_path, "explain", model="m")
        daemon.request_stop()
    if not able:
        assert clear == bad_replica == {"ok": False, "error": "clear-feedback is an operator command"}
        assert explain == {"ok": False, "error": "explain is a gateway command (this gridd runs as "
                                                 "operator); run it against a gateway's socket"}
        return
    assert role.reload == daemon.reload  # attached: the providers API reloads like SIGHUP
    assert clear == {"ok": True, "cleared": ["g2"]} and role.cleared == ["g2"]
    assert bad_replica == {"ok": False, "error": "replica must be a string"}
    assert explain == {"ok": True, "explain": {"model": "m"}}


async def test_ready_only_after_servers_then_reload_and_drain(workspace, mock_clock):
    sink = NotifySink(workspace / "notify.sock")
    await sink.bind()
    env = {"NOTIFY_SOCKET": str(sink.path)}
    loaded = load_config(workspace / "gridd.yaml", env=env)
    role = FakeRole()
    daemon = Daemon(loaded, env=env, role=role)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(daemon.run)
        ready = await sink.next()
        assert ready[0] == "READY=1"
        # READY=1 means the control socket and the metrics listener already serve.
        assert (workspace / "run" / "gridd.sock").exists()
        assert oct(os.stat(workspace / "run" / "gridd.sock").st_mode & 0o777) == "0o660"
        assert daemon.metrics_urls and daemon.metrics_urls[0].startswith("http://127.0.0.1:")
        status = (await _request(daemon.control_path, "status"))["status"]
        assert (status["role"], status["site"], status["state"]) == ("operator", "a", "serving")
        assert {"signals", "control-socket", "metrics-listener", "operator-service", "reload-worker"} <= set(
            status["tasks"])
        assert status["role_status"] == {"fake": True}

        # a good reload: RELOADING=1 with MONOTONIC_USEC, then READY=1; committed
        (workspace / "gridd.yaml").write_text(OPERATOR.format(name="second"))
        reply = await _request(daemon.control_path, "reload")
        assert reply["ok"] is True and reply["reload"]["result"] == "ok"
        reloading = await sink.next()
        assert reloading[0] == "RELOADING=1" and reloading[1].startswith("MONOTONIC_USEC=")
        assert int(reloading[1].split("=")[1]) > 0
        assert (await sink.next())[0] == "READY=1"
        assert role.committed == ["second"]
        assert daemon.loaded.config.providers[0].name == "second"

        # a broken file: rejected, old config kept, counted
        (workspace / "gridd.yaml").write_text("role: operator\nsite: a\nbogus: 1\n")
        reply = await _request(daemon.control_path, "reload")
        assert reply["ok"] is False and "bogus: unknown field" in reply["reload"]["error"]
        assert daemon.loaded.config.providers[0].name == "second"
        assert daemon.registry.get_sample_value("gridd_config_reloads_total", {"result": "ok"}) == 1
        assert daemon.registry.get_sample_value("gridd_config_reloads_total", {"result": "error"}) == 1
        await sink.next()
        await sink.next()

        # a role that rejects staging (e.g. a bad certificate): nothing committed
        (workspace / "gridd.yaml").write_text(OPERATOR.format(name="third"))
        role.reject_next = "tls: key does not match certificate"
        reply = await _request(daemon.control_path, "reload")
        assert reply["reload"]["error"] == "tls: key does not match certificate"
        assert role.committed == ["second"]
        await sink.next()
        await sink.next()

        # role or site changes need a restart
        role.reject_next = None
        (workspace / "gridd.yaml").write_text(OPERATOR.format(name="x").replace("site: a", "site: b"))
        reply = await _request(daemon.control_path, "reload")
        assert "role/site changed" in reply["reload"]["error"]
        await sink.next()
        await sink.next()

        # drain: STOPPING=1, the role drains, run() returns and the socket is gone
        daemon.request_stop()
        assert (await sink.next())[0] == "STOPPING=1"
    assert role.drained
    assert not (workspace / "run" / "gridd.sock").exists()


async def test_drain_deadline_cancels_a_hanging_drain(workspace, mock_clock):
    loaded = load_config(workspace / "gridd.yaml", env={})
    role = FakeRole()
    role.drain_forever = True
    daemon = Daemon(loaded, env={}, role=role)
    async with trio.open_nursery() as nursery:
        await nursery.start(daemon.run)
        start = trio.current_time()
        daemon.request_stop()
        await trio.testing.wait_all_tasks_blocked()
        mock_clock.jump(9.999)
        await trio.testing.wait_all_tasks_blocked()
        assert daemon.status()["state"] == "draining" and not role.drained
        assert nursery.child_tasks  # still draining just before the 10 s grace ends
        mock_clock.jump(0.001)
    # the grace period (drain_grace_s = 10) ended the drain on its deadline exactly
    assert trio.current_time() - start == pytest.approx(10.0)
    assert not role.drained


async def test_watchdog_pings_at_half_the_interval(workspace, mock_clock):
    sink = NotifySink(workspace / "notify.sock")
    await sink.bind()
    env = {"NOTIFY_SOCKET": str(sink.path), "WATCHDOG_USEC": "4000000"}
    daemon = Daemon(load_config(workspace / "gridd.yaml", env=env), env=env, role=FakeRole())
    assert daemon.notifier.watchdog_interval_s == 2.0
    async with trio.open_nursery() as nursery:
        nursery.start_soon(daemon.run)
        seen = []
        while len([m for m in seen if m == ["WATCHDOG=1"]]) < 3:
            msg = await sink.next()
            seen.append(msg)
            if msg == ["WATCHDOG=1"]:
                times = getattr(sink, "times", [])
                times.append(trio.current_time())
                sink.times = times
                mock_clock.jump(2.0)
        assert [b - a for a, b in zip(sink.times, sink.times[1:], strict=False)] == [2.0, 2.0]
        daemon.request_stop()


def test_watchdog_ignored_for_another_pid():
    assert Notifier({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"}).watchdog_interval_s is None
    assert Notifier({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid())}).watchdog_interval_s == 0.5
    assert Notifier({}).enabled is False


async def test_control_socket_rejects_bad_requests_and_a_second_daemon(workspace):
    loaded = load_config(workspace / "gridd.yaml", env={})
    daemon = Daemon(loaded, env={}, role=FakeRole())
    async with trio.open_nursery() as nursery:
        await nursery.start(daemon.run)
        assert (await _request(daemon.control_path, "frobnicate"))["error"].startswith("unknown command")

        def raw(payload: bytes) -> dict:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(str(daemon.control_path))
                s.sendall(payload)
                s.shutdown(socket.SHUT_WR)
                return json.loads(s.makefile().read())

        assert "bad request" in (await trio.to_thread.run_sync(raw, b"not json\n"))["error"]
        assert "bad request" in (await trio.to_thread.run_sync(raw, b"[1,2]\n"))["error"]
        second = Daemon(loaded, env={}, role=FakeRole())
        with pytest.raises(ControlError, match="another gridd is already listening"):
            await second.run()
        daemon.request_stop()


def test_stale_socket_file_is_replaced_and_dead_socket_reported(tmp_path):
    path = tmp_path / "dead.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()  # a socket file nobody listens on, as a crashed daemon leaves it
    with pytest.raises(ControlError, match="control socket is dead"):
        control.request(path, "status")
    with pytest.raises(ControlError, match="no control socket"):
        control.request(tmp_path / "absent.sock", "status")


# -- real processes ---------------------------------------------------------------------------


def _gridd(*args, env=None, **kw):
    return subprocess.Popen([sys.executable, "-m", "gridd", *args], env=env, **kw)


def _gridctl(*args, timeout=30):
    code = "from gridd.cli import gridctl_main; raise SystemExit(gridctl_main())"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.realproc
def test_real_process_status_reload_and_sigterm(tmp_path):
    config = tmp_path / "gridd.yaml"
    config.write_text(OPERATOR.format(name="first"))
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    notify.settimeout(30)
    env = {**os.environ, "NOTIFY_SOCKET": str(tmp_path / "notify.sock")}
    proc = _gridd("run", "--config", str(config), env=env, stderr=subprocess.PIPE, text=True)
    try:
        assert notify.recv(4096).startswith(b"READY=1")
        sock = str(tmp_path / "run" / "gridd.sock")
        status = _gridctl("--socket", sock, "status", "--json")
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["status"]["role"] == "operator"
        human = _gridctl("--socket", sock, "status")
        assert "role        operator" in human.stdout and "last reload none" in human.stdout

        config.write_text("role: operator\nsite: a\nproviders: 7\n")
        proc.send_signal(signal.SIGHUP)
        assert notify.recv(4096).startswith(b"RELOADING=1")
        assert notify.recv(4096).startswith(b"READY=1")
        after = json.loads(_gridctl("--socket", sock, "status", "--json").stdout)["status"]
        assert after["last_reload"]["result"] == "error"
        assert "providers: expected a list, got 7" in after["last_reload"]["error"]

        proc.send_signal(signal.SIGTERM)
        assert notify.recv(4096).startswith(b"STOPPING=1")
        assert proc.wait(timeout=15) == 0
        err = proc.stderr.read()
        lines = [line for line in err.splitlines() if line]
        assert lines and all(line[0] == "<" and line[2] == ">" for line in lines), err
        assert any(line.startswith("<3>") and "rejected" in line for line in lines)
    finally:
        if proc.poll() is None:
            proc.kill()
        notify.close()
    gone = _gridctl("--socket", str(tmp_path / "run" / "gridd.sock"), "status")
    assert gone.returncode == 1 and gone.stderr.startswith("gridctl: ") and len(gone.stderr.splitlines()) == 1
