"""The signals channel between real gridd processes on loopback, with real mutual TLS.

Two simulated EPPs (``gridd sim``), operators a and b peering each other, and an
"operator" c whose certificate comes from another CA. Certificates are made with
``gridd certs``. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from realproc import PEERED_OPERATOR, Processes

pytestmark = pytest.mark.realproc

WAIT_S = 20.0



def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "gridd", *args], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


def wait_for(what: str, check: Callable[[], object], timeout: float = WAIT_S) -> object:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.2)


def metrics(port: int) -> str:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    except httpx.HTTPError:
        return ""


def provider_sites(text: str) -> set[str]:
    return set(re.findall(r'^grid_provider_\w+\{[^}]*\bgrid_site="([^"]+)"', text, re.M))


def epochs(text: str, site: str) -> set[int]:
    lines = re.findall(r"^grid_provider_config_generation\{([^}]*)\}", text, re.M)
    return {int(m.group(1)) for labels in lines if f'grid_site="{site}"' in labels
            and (m := re.search(r'publisher_epoch="(\d+)"', labels))}


def refused(text: str, reason: str) -> float:
    m = re.search(rf'^grid_signals_connections_refused_total\{{reason="{reason}"\}} (\S+)', text, re.M)
    return float(m.group(1)) if m else 0.0


def status(directory: Path, site: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", "from gridd.cli import gridctl_main; raise SystemExit(gridctl_main())",
         "--socket", str(directory / "run" / f"{site}.sock"), "status", "--json"],
        capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["status"]["role_status"]


def peer_status(directory: Path, site: str, peer: str) -> dict:
    return next(p for p in status(directory, site)["peers"] if p["site"] == peer)


def test_two_operators_share_signals_and_refuse_strangers(tmp_path):
    run("certs", "init", str(tmp_path / "certs"))
    run("certs", "issue", str(tmp_path / "certs"), "--site", "a", "--role", "operator")
    run("certs", "issue", str(tmp_path / "certs"), "--site", "b", "--role", "operator")
    run("certs", "init", str(tmp_path / "other"))  # another CA, same trust domain name
    run("certs", "issue", str(tmp_path / "other"), "--site", "c", "--role", "operator")
    # c trusts the grid CA too, so it gets as far as presenting its own certificate,
    # which a does not trust.
    bundle = (tmp_path / "other" / "ca.pem").read_bytes() + (tmp_path / "certs" / "ca.pem").read_bytes()
    (tmp_path / "other" / "ca.pem").write_bytes(bundle)

    ports = {name: (free_port(), free_port()) for name in "abc"}  # (metrics, signals)

    def peer(site: str, port_of: str | None = None) -> str:
        return f'  - {{site: {site}, url: "wss://127.0.0.1:{ports[port_of or site][1]}/signals"}}'

    def write(site: str, certs: str, providers: str, peers: list[str]) -> Path:
        path = tmp_path / f"{site}.yaml"
        path.write_text(PEERED_OPERATOR.format(
            site=site, certs=certs, metrics=ports[site][0], signals=ports[site][1], providers=providers,
            peers="\n".join(peers) or "  []",
            timings="{peer_poll_interval_s: 1, peer_poll_budget_s: 2, signal_ttl_s: 4}"))
        return path

    with Processes(tmp_path) as procs:
        procs.start("sim-a", "sim", "--port", "0")
        procs.start("sim-b", "sim", "--port", "0")
        sims = {site: procs.sim_url(f"sim-{site}") for site in "ab"}

        def provider(site: str) -> str:
            return (f'  - {{name: p{site}, model: sim-model, settings: {{endpoint: "{sims[site]}/v1"}}, '
                    f'metrics: {{url: "{sims[site]}/metrics"}}}}')

        # a also lists a peer "d" at b's address: b's certificate names site b, so a's
        # poller refuses it (identity) while the real b keeps flowing.
        config = {
            "a": write("a", "certs", provider("a"), [peer("b"), peer("d", port_of="b")]),
            "b": write("b", "certs", provider("b"), [peer("a")]),
            "c": write("c", "other", "  []", [peer("a")]),
        }
        for site in "abc":
            procs.start(site, "run", "--config", str(config[site]))

        # Each operator's /metrics shows both sites' grid_provider_* series.
        for site in "ab":
            wait_for(f"{site} to show both sites",
                     lambda s=site: provider_sites(metrics(ports[s][0])) >= {"a", "b"})

        a_metrics = metrics(ports["a"][0])
        # c's certificate is from another CA: refused at the TLS handshake, and counted.
        wait_for("a to count c's refusal", lambda: refused(metrics(ports["a"][0]), "tls") >= 1)
        wait_for("a's poller of peer d to refuse b's certificate",
                 lambda: peer_status(tmp_path, "a", "d")["last_error"] == "identity")
        peers = {p["site"]: p for p in status(tmp_path, "a")["peers"]}
        assert peers["b"]["state"] == "up" and peers["d"]["state"] == "down"
        assert re.search(r"peer d \(\S+\) is (still )?down(, now)? \(identity\)", procs.log("a"))

        # Kill b: a's copy of b's series disappears after the 4 s TTL; a's own stay.
        b_epochs = epochs(a_metrics, "b")
        assert len(b_epochs) == 1
        procs.kill("b")
        killed_at = time.monotonic()
        wait_for("b's series to leave a", lambda: "b" not in provider_sites(metrics(ports["a"][0])))
        # Held until it aged past the TTL (its age at the kill is at most ~2 s), not dropped at once.
        assert time.monotonic() - killed_at >= 1.0
        assert "a" in provider_sites(metrics(ports["a"][0]))
        wait_for("a to see b down", lambda: peer_status(tmp_path, "a", "b")["state"] == "down")

        # Restart b: flow resumes under a higher publisher epoch.
        procs.start("b", "run", "--config", str(config["b"]))
        new_epochs = wait_for("b's series to return to a", lambda: epochs(metrics(ports["a"][0]), "b"))
        assert min(new_epochs) > max(b_epochs)
        wait_for("a to see b up", lambda: peer_status(tmp_path, "a", "b")["state"] == "up")
        assert "b" in provider_sites(metrics(ports["a"][0]))


def test_operator_with_mismatched_certificate_exits_1(tmp_path):
    run("certs", "init", str(tmp_path / "certs"))
    run("certs", "issue", str(tmp_path / "certs"), "--site", "b", "--role", "operator")
    path = tmp_path / "a.yaml"
    path.write_text(
        "role: operator\nsite: a\nstate_dir: state\ncontrol_socket: run/a.sock\n"
        "tls: {ca: certs/ca.pem, cert: certs/b-operator.pem, key: certs/b-operator-key.pem}\n"
        f'listen: {{signals: "127.0.0.1:{free_port()}"}}\n'
    )
    done = subprocess.run([sys.executable, "-m", "gridd", "run", "--config", str(path)],
                          capture_output=True, text=True, timeout=30, env={**os.environ, "NOTIFY_SOCKET": ""})
    assert done.returncode == 1, done.stderr
    assert "does not match expected site 'a'" in done.stderr
