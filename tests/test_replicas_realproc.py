"""Gateway replicas on one host through real processes on loopback (issue 13, "All cores"):
two gateways with their own identities (certificates, metrics ports, control sockets, state)
bind the same front port with listen.http_reuse_port, both get their operator's routing data
over mutual TLS, and new client connections to that one port are served by both."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx
import pytest
from realproc import Processes, gridctl_status, wait_until

from gridd.childprocs import free_ports

pytestmark = pytest.mark.realproc
MODEL = "sim-model"

OPERATOR = """
role: operator
site: a
tls: {{ca: certs/ca.pem, cert: certs/a-operator.pem, key: certs/a-operator-key.pem}}
listen: {{signals: "127.0.0.1:{signals}"}}
control_socket: run/op.sock
state_dir: state/op
providers:
  - name: sim
    model: {model}
    settings: {{endpoint: "{sim}/v1"}}
    metrics: {{url: "{sim}/metrics"}}
"""

GATEWAY = """
role: gateway
site: a
replica: {replica}
tls: {{ca: certs/ca.pem, cert: certs/a-gateway-{replica}.pem, key: certs/a-gateway-{replica}-key.pem}}
listen: {{http: "127.0.0.1:{front}", http_reuse_port: true, metrics: "127.0.0.1:{metrics}"}}
control_socket: run/{replica}.sock
state_dir: state/{replica}
operator: {{url: "wss://127.0.0.1:{signals}/signals"}}
"""


def ok_requests(metrics_port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2).text
    return sum(float(v) for v in re.findall(r'^gridd_gateway_requests_total\{[^}]*outcome="ok"[^}]*\} (\S+)$',
                                            text, re.M))


def test_two_gateway_replicas_share_the_front_port(tmp_path):
    signals, front, metrics_g1, metrics_g2 = free_ports(4)
    metrics = {"g1": metrics_g1, "g2": metrics_g2}
    for args in (["init"], ["issue", "--site", "a", "--role", "operator"],
                 ["issue", "--site", "a", "--role", "gateway", "--replica", "g1"],
                 ["issue", "--site", "a", "--role", "gateway", "--replica", "g2"]):
        done = subprocess.run([sys.executable, "-m", "gridd", "certs", args[0],
                               str(tmp_path / "certs"), *args[1:]],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
    with Processes(tmp_path) as procs:
        procs.start("sim", "sim", "--port", "0", "--model", MODEL)
        sim = procs.sim_url("sim")
        (tmp_path / "op.yaml").write_text(OPERATOR.format(signals=signals, sim=sim, model=MODEL))
        procs.start("op", "run", "--config", str(tmp_path / "op.yaml"))
        for replica in ("g1", "g2"):
            (tmp_path / f"{replica}.yaml").write_text(GATEWAY.format(
                replica=replica, front=front, metrics=metrics[replica], signals=signals))
            procs.start(replica, "run", "--config", str(tmp_path / f"{replica}.yaml"))
        for replica in ("g1", "g2"):
            wait_until(lambda r=replica: (s := gridctl_status(tmp_path / "run" / f"{r}.sock")) is not None
                       and s["role_status"]["operator_state"] == "up"
                       and s["role_status"]["models"] == [MODEL], f"replica {replica} with routing data")
        # A new connection per request (no client pool): the kernel spreads them over both
        # replicas. Bounded: at most 200 requests, each must be answered.
        for sent in range(1, 201):
            r = httpx.post(f"http://127.0.0.1:{front}/v1/chat/completions", timeout=10,
                           json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                 "max_tokens": 2})
            assert r.status_code == 200, r.text
            if sent % 10 == 0 and all(ok_requests(metrics[r]) > 0 for r in ("g1", "g2")):
                break
        # A request is counted just after its last byte went out: wait for the last count.
        served = wait_until(lambda: (s := {r: ok_requests(metrics[r]) for r in ("g1", "g2")})
                            and sum(s.values()) == sent and s, f"{sent} requests counted")
        print(f"{sent} requests, served {served}")
        assert all(count > 0 for count in served.values()), served
