"""The example configs run as shipped: certificates from `gridd certs`, then `gridd run` for
the operator and the gateway; gridctl answers, SIGHUP reloads (a broken file keeps the old
config and says so), SIGTERM exits 0 within the drain deadline."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time

import pytest
from realproc import gridctl

from gridd.config import load_config

pytestmark = pytest.mark.realproc
REPO = __import__("pathlib").Path(__file__).resolve().parent.parent


def wait_status(sock, deadline_s=20.0) -> dict:
    """Status once the daemon is serving (its control socket answers earlier, "starting")."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        out = gridctl(sock, "status", "--json")
        if out.returncode == 0 and (status := json.loads(out.stdout)["status"])["state"] == "serving":
            return status
        time.sleep(0.2)
    raise AssertionError(f"no status on {sock}: {out.stderr}")


def test_example_configs_run(tmp_path):
    ws = tmp_path / "examples"
    shutil.copytree(REPO / "examples", ws, ignore=shutil.ignore_patterns("var", "certs"))
    certs = ws / "certs"
    for args in (["init", str(certs)], ["issue", "--site", "a", "--role", "operator", str(certs)],
                 ["issue", "--site", "a", "--role", "gateway", "--replica", "g1", str(certs)]):
        assert subprocess.run([sys.executable, "-m", "gridd", "certs", *args], capture_output=True,
                              timeout=60).returncode == 0
    procs = {}
    try:
        for role in ("operator", "gateway"):
            procs[role] = subprocess.Popen([sys.executable, "-m", "gridd", "run", "--config",
                                            str(ws / f"{role}.yaml")],
                                           stderr=subprocess.PIPE, text=True)
        op_sock = load_config(ws / "operator.yaml").resolve("var/run/operator-a.sock")
        gw_sock = load_config(ws / "gateway.yaml").resolve("var/run/gateway-a-g1.sock")
        assert wait_status(op_sock)["role"] == "operator"
        gw = wait_status(gw_sock)
        assert gw["role"] == "gateway" and gw["role_status"]["front"] == ["http://127.0.0.1:8000"]
        end = time.monotonic() + 20
        while wait_status(gw_sock)["role_status"]["operator_state"] != "up":
            assert time.monotonic() < end, "gateway never reached its operator"
            time.sleep(0.2)

        cleared = gridctl(op_sock, "clear-feedback")
        assert cleared.returncode == 0 and cleared.stdout.strip() == "cleared: nothing was unresolved"
        wrong_role = gridctl(gw_sock, "clear-feedback", "--replica", "g1")
        assert wrong_role.returncode == 1 and "operator command" in wrong_role.stderr
        explain_op = gridctl(op_sock, "explain", "m")
        assert explain_op.returncode == 1 and "explain is a gateway command" in explain_op.stderr

        good = (ws / "operator.yaml").read_text()
        (ws / "operator.yaml").write_text(good.replace("scrape_interval_s: 1", "scrape_interval_s: -1"))
        procs["operator"].send_signal(signal.SIGHUP)
        end = time.monotonic() + 20
        while (st := wait_status(op_sock))["last_reload"]["result"] == "none":
            assert time.monotonic() < end
            time.sleep(0.2)
        assert st["last_reload"]["result"] == "error"
        assert "timings.scrape_interval_s: expected a number > 0, got -1" in st["last_reload"]["error"]
        (ws / "operator.yaml").write_text(good)
        reload = gridctl(op_sock, "reload")
        assert reload.returncode == 0 and reload.stdout.strip() == "reload: ok"

        for role, proc in procs.items():
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=15) == 0, role
            err = proc.stderr.read()
            assert "stopped" in err and all(line[:1] == "<" for line in err.splitlines() if line), err
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()


def test_operator_unit_lets_the_providers_api_rewrite_its_config():
    """The issue: ProtectSystem=strict made /etc read-only, so under the shipped unit the
    providers API could not rewrite the config (write_durably renames a temporary file in the
    config's own directory)."""
    unit = (REPO / "systemd" / "gridd-operator.service").read_text()
    settings = [line.split("=", 1) for line in unit.splitlines() if "=" in line and not line.startswith("#")]
    config = next(v for k, v in settings if k == "Environment" and v.startswith("GRIDD_CONFIG="))
    writable = [p for k, v in settings if k == "ReadWritePaths" for p in v.split()]
    assert ("ProtectSystem", "strict") in [tuple(s) for s in settings]
    assert str(REPO.__class__(config.split("=", 1)[1]).parent) in writable
