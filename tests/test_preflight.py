"""`gridd check-config` refuses what `gridd run` would refuse (gridd.preflight): TLS material
present, loadable, chained to the CA, key matching, identity of this role/site/replica; wss://
for the signals channel; listen addresses that parse. Each message names the path and the fix."""

from __future__ import annotations

import contextlib
import io
import pathlib
import shutil
import subprocess
import sys
import time

import pytest

from gridd import certs
from gridd.cli import gridd_main
from gridd.config import load_config
from gridd.errors import ConfigError
from gridd.preflight import check_runnable

REPO = pathlib.Path(__file__).resolve().parent.parent

GATEWAY = """
role: gateway
site: a
replica: g1
tls: {ca: certs/ca.pem, cert: CERT, key: KEY}
listen: {http: "127.0.0.1:8000", metrics: "127.0.0.1:9101"}
operator: {url: "wss://127.0.0.1:9443/signals"}
"""

OPERATOR = """
role: operator
site: a
tls: {ca: certs/ca.pem, cert: certs/a-operator.pem, key: certs/a-operator-key.pem}
listen: {signals: "127.0.0.1:9443", metrics: "127.0.0.1:9100"}
providers:
  - name: epp
    model: m
    settings: {endpoint: "http://127.0.0.1:8088/v1"}
    metrics: {url: "http://127.0.0.1:8088/metrics"}
  - name: local
    model: m
    settings:
      endpoint: "http://127.0.0.1:8089/v1"
      probes: [{name: perf, extract: [{regex: 'vllm:(num_requests_waiting)\\{[^}]*\\}\\s+([0-9.]+)'}]}]
  - name: bare
    model: m
    settings: {endpoint: "http://127.0.0.1:8090/v1"}
"""


def certs_cli(*args: str) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        assert certs.main(list(args)) == 0


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> pathlib.Path:
    ws = tmp_path_factory.mktemp("ws")
    certs_cli("init", str(ws / "certs"))
    certs_cli("issue", "--site", "a", "--role", "operator", str(ws / "certs"))
    certs_cli("issue", "--site", "a", "--role", "gateway", "--replica", "g1", str(ws / "certs"))
    certs_cli("init", str(ws / "other"))
    certs_cli("issue", "--site", "a", "--role", "gateway", "--replica", "g1", str(ws / "other"))
    return ws


def gateway(ws: pathlib.Path, cert="certs/a-gateway-g1.pem", key="certs/a-gateway-g1-key.pem") -> str:
    return GATEWAY.replace("CERT", cert).replace("KEY", key)


def check(ws: pathlib.Path, text: str) -> list[str]:
    path = ws / "c.yaml"
    path.write_text(text)
    return check_runnable(load_config(path, env={}), time.time())


def refused(ws: pathlib.Path, text: str) -> str:
    with pytest.raises(ConfigError) as info:
        check(ws, text)
    return str(info.value)


def test_a_good_gateway_passes(workspace):
    assert check(workspace, gateway(workspace)) == []


def test_a_gateway_without_tls_is_refused_with_the_fix(workspace):
    text = gateway(workspace).replace("tls: {ca: certs/ca.pem, cert: certs/a-gateway-g1.pem, "
                                      "key: certs/a-gateway-g1-key.pem}\n", "")
    assert refused(workspace, text) == (
        "tls: a gateway needs its certificate to poll its operator over mutual TLS; "
        "add tls: {ca, cert, key} (gridd certs issue --role gateway --replica R)")


def test_a_gateway_with_the_operators_certificate_is_refused(workspace):
    message = refused(workspace, gateway(workspace, "certs/a-operator.pem", "certs/a-operator-key.pem"))
    assert message.startswith(f"tls.cert: {workspace / 'certs/a-operator.pem'}: identity "
                              "spiffe://grid.local/site/a/operator does not match expected role 'gateway'")
    assert message.endswith("; issue a certificate for this role, site and replica: "
                            "gridd certs issue --site a --role gateway --replica g1 DIR")


def test_an_http_operator_url_is_refused(workspace):
    text = gateway(workspace).replace("wss://127.0.0.1:9443/signals", "http://127.0.0.1:9443/signals")
    assert refused(workspace, text) == (
        "operator.url: expected the operator's signals URL, wss://host:port/signals (its listen.signals), "
        "got 'http://127.0.0.1:9443/signals'")


def test_a_key_of_another_certificate_is_refused(workspace):
    message = refused(workspace, gateway(workspace, key="certs/a-operator-key.pem"))
    assert message == (f"tls.key: {workspace / 'certs/a-operator-key.pem'}: private key does not match "
                       f"certificate {workspace / 'certs/a-gateway-g1.pem'}; "
                       "use the key issued together with this certificate")


def test_a_certificate_of_another_ca_is_refused(workspace):
    message = refused(workspace, gateway(workspace, "other/a-gateway-g1.pem", "other/a-gateway-g1-key.pem"))
    assert message.startswith(f"tls.cert: {workspace / 'other/a-gateway-g1.pem'}: does not chain to the CA in "
                              f"{workspace / 'certs/ca.pem'}")
    assert message.endswith("; issue the certificate from the grid CA named in tls.ca, or point tls.ca at its issuer")


def test_a_missing_file_is_named_by_its_config_path(workspace):
    message = refused(workspace, gateway(workspace).replace("certs/ca.pem", "certs/nope.pem"))
    assert message == (f"tls.ca: {workspace / 'certs/nope.pem'}: CA file not found; "
                       "make the file readable by gridd, or make it: gridd certs init DIR")


@pytest.mark.parametrize("bind", ["127.0.0.1:99999", "[::1]:65536"])
def test_listen_addresses_must_parse(workspace, bind):
    assert refused(workspace, gateway(workspace).replace("127.0.0.1:9101", bind)) == (
        f"listen.metrics: bind {bind!r} is not host:port, [v6]:port or unix:/path; "
        "write host:port with a port up to 65535, e.g. 127.0.0.1:9100")


def test_operator_rules_and_providers_without_metrics(workspace):
    assert check(workspace, OPERATOR) == [
        "providers[1] (local): no metrics block: no readiness or load from an EPP; judged by its probes only (perf)",
        "providers[2] (bare): no metrics block: no readiness or load from an EPP; and no probes: it publishes "
        "no signal at all",
    ]
    # The operator's own start-time rules are checked too (here: peers need wss://).
    peers = OPERATOR + "peers: [{site: b, url: 'https://b:9443/signals'}, {site: c, url: 'http://c:1/s'}]\n"
    assert refused(workspace, peers) == "peers[1].url: expected a wss://host:port/path URL, got 'http://c:1/s'"
    assert "does not match expected role 'operator'" in refused(
        workspace, OPERATOR.replace("a-operator", "a-gateway-g1"))


def test_the_command_prints_the_path_and_exits_2(workspace, capsys):
    bad = workspace / "bad.yaml"
    bad.write_text(gateway(workspace, "certs/a-operator.pem", "certs/a-operator-key.pem"))
    assert gridd_main(["check-config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"invalid config: {bad}: tls.cert: ") and err.count("\n") == 1
    good = workspace / "good.yaml"
    good.write_text(OPERATOR)
    assert gridd_main(["check-config", str(good)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{good}: ok (operator for site a, 3 providers, 0 peers)"
    assert out[1].startswith("note: providers[1] (local): no metrics block")


def test_the_examples_pass_once_their_certificates_exist(tmp_path):
    ws = tmp_path / "examples"
    shutil.copytree(REPO / "examples", ws, ignore=shutil.ignore_patterns("var", "certs"))
    run = [sys.executable, "-m", "gridd", "check-config"]
    before = subprocess.run([*run, str(ws / "gateway.yaml")], capture_output=True, text=True, timeout=60)
    assert before.returncode == 2
    assert before.stderr == (f"invalid config: {ws / 'gateway.yaml'}: tls.cert: {ws / 'certs/a-gateway-g1.pem'}: "
                             "certificate file not found; make the file readable by gridd, or make it: "
                             "gridd certs issue --site a --role gateway --replica g1 DIR\n")
    certs_cli("init", str(ws / "certs"))
    certs_cli("issue", "--site", "a", "--role", "operator", str(ws / "certs"))
    certs_cli("issue", "--site", "a", "--role", "gateway", "--replica", "g1", str(ws / "certs"))
    for name in ("operator.yaml", "gateway.yaml"):
        proc = subprocess.run([*run, str(ws / name)], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith(f"{ws / name}: ok (")


def test_run_refuses_an_unbindable_listen_address_in_one_line(tmp_path):
    config = tmp_path / "op.yaml"
    config.write_text("role: operator\nsite: a\nlisten: {metrics: '127.0.0.1:70000'}\n"
                      f"control_socket: {tmp_path / 'op.sock'}\nstate_dir: {tmp_path / 'state'}\n")
    proc = subprocess.run([sys.executable, "-m", "gridd", "run", "--config", str(config)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[-1] == (
        "<3>gridd: cannot run: listen.metrics: bind '127.0.0.1:70000' is not host:port, [v6]:port or unix:/path; "
        "write host:port with a port up to 65535, e.g. 127.0.0.1:9100")
