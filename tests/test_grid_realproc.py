"""The whole grid through real processes on loopback with real TLS certificates from
`gridd certs`: two simulators, two operators peering over mutual TLS, two gateways, and the
official openai SDK as the client. Polls are sped up (peer poll 1 s) to keep it short.
gridctl explain and watch read the running gateways; a third gateway pointed at a port no
operator listens on shows how a broken setup reads (degraded, 503 naming the cause)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import httpx
import openai
import pytest
from docs_tables import backticked, table_rows
from prometheus_client.parser import text_string_to_metric_families
from realproc import wait_until

from gridd.childprocs import free_ports, stop_processes

pytestmark = pytest.mark.realproc
MODEL = "grid-model"




def gridd(*args: str, log=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gridd", *args], stdout=log or subprocess.DEVNULL,
                            stderr=log or subprocess.DEVNULL, env={**os.environ})




@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    ws = tmp_path_factory.mktemp("grid")
    certs = ws / "certs"
    assert subprocess.run([sys.executable, "-m", "gridd", "certs", "init", str(certs)],
                          capture_output=True, timeout=60).returncode == 0
    for site in ("a", "b"):
        for role in (["--role", "operator"], ["--role", "gateway", "--replica", "g1"]):
            assert subprocess.run([sys.executable, "-m", "gridd", "certs", "issue", "--site", site, *role,
                                   str(certs)], capture_output=True, timeout=60).returncode == 0
    p = dict(zip(["sim-a", "sim-b", "sig-a", "sig-b", "gw-a", "gw-b", "met-a", "met-b", "gmet-a", "gmet-b"],
                 free_ports(10), strict=True))
    for site, other in (("a", "b"), ("b", "a")):
        (ws / f"op-{site}.yaml").write_text(rf"""
role: operator
site: {site}
tls: {{ca: certs/ca.pem, cert: certs/{site}-operator.pem, key: certs/{site}-operator-key.pem}}
listen: {{metrics: "127.0.0.1:{p[f'met-{site}']}", signals: "127.0.0.1:{p[f'sig-{site}']}"}}
control_socket: run/op-{site}.sock
state_dir: state/op-{site}
ingress: http://127.0.0.1:{p[f'gw-{site}']}
providers:
  - name: pool-{site}
    model: {MODEL}
    settings:
      endpoint: "http://127.0.0.1:{p[f'sim-{site}']}/v1"
      probes:
        - name: perf
          endpoint: "http://127.0.0.1:{p[f'sim-{site}']}/metrics"
          interval: 1
          extract: [{{regex: 'vllm:(num_requests_waiting)\{{[^}}]*\}}\s+([0-9.eE+-]+)'}}]
    metrics: {{url: "http://127.0.0.1:{p[f'sim-{site}']}/metrics"}}
peers:
  - {{site: {other}, url: "wss://127.0.0.1:{p[f'sig-{other}']}/signals", ingress: "http://127.0.0.1:{p[f'gw-{other}']}"}}
timings: {{peer_poll_interval_s: 1, peer_poll_budget_s: 2}}
""")
        (ws / f"gw-{site}.yaml").write_text(f"""
role: gateway
site: {site}
replica: g1
tls: {{ca: certs/ca.pem, cert: certs/{site}-gateway-g1.pem, key: certs/{site}-gateway-g1-key.pem}}
listen: {{http: "127.0.0.1:{p[f'gw-{site}']}", metrics: "127.0.0.1:{p[f'gmet-{site}']}"}}
control_socket: run/gw-{site}.sock
operator: {{url: "wss://127.0.0.1:{p[f'sig-{site}']}/signals"}}
availability: {{shedding: {{enabled: true}}}}
""")
    log = open(ws / "grid.log", "ab")  # noqa: SIM115 - closed below
    procs = [gridd("sim", "--port", str(p[f"sim-{s}"]), "--model", MODEL, "--endpoints", "2",
                   "--max-seqs", "4", "--ttft-s", "0.02", "--tpot-s", "0.01", "--pool", f"pool-{s}", log=log)
             for s in ("a", "b")]
    procs += [gridd("run", "--config", str(ws / f"{kind}-{s}.yaml"), log=log)
              for kind in ("op", "gw") for s in ("a", "b")]
    try:
        yield {"ws": ws, "ports": p, "procs": procs}
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=20))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append("killed")
        log.close()
    assert codes[2:] == [0, 0, 0, 0], (codes, (ws / "grid.log").read_text()[-3000:])


def gridctl(grid, name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c",
                           "from gridd.cli import gridctl_main; raise SystemExit(gridctl_main())",
                           "--socket", str(grid["ws"] / "run" / f"{name}.sock"), *args],
                          capture_output=True, text=True, timeout=30)


def gridctl_json(grid, name: str) -> dict:
    out = gridctl(grid, name, "status", "--json")
    if out.returncode != 0:
        raise ValueError(f"gridctl: {out.stderr.strip()}")  # not up yet: wait_until retries
    return json.loads(out.stdout)["status"]


def candidate_sites(grid, name: str) -> set[str]:
    """The sites gateway ``name`` holds candidates of (gridctl status)."""
    return {c["site"] for c in gridctl_json(grid, name)["role_status"]["candidates"]}


def test_operators_export_both_sites_and_gateway_holds_one_connection(grid):
    p = grid["ports"]
    for site in ("a", "b"):
        def both(site=site):
            text = httpx.get(f"http://127.0.0.1:{p[f'met-{site}']}/metrics", timeout=2).text
            return all(re.search(rf'grid_provider_ready\{{grid_provider="pool-{s}",grid_site="{s}"\}} 1\.0',
                                 text) for s in ("a", "b"))
        wait_until(both, f"operator {site} exporting both sites")
    gw = wait_until(lambda: (s := gridctl_json(grid, "gw-a"))["role_status"]["operator_state"] == "up" and
                    {c["site"] for c in s["role_status"]["candidates"]} == {"a", "b"} and s,
                    "gateway a's store")
    assert gw["role_status"]["models"] == [MODEL]
    op = gridctl_json(grid, "op-a")
    # the gateway's one connection is its operator's only gateway connection
    assert op["role_status"]["signals"]["connections"]["gateway"] == 1
    assert {peer["site"]: peer["state"] for peer in op["role_status"]["peers"]} == {"b": "up"}


def test_openai_sdk_through_the_grid(grid):
    p = grid["ports"]
    wait_until(lambda: httpx.get(f"http://127.0.0.1:{p['gw-a']}/readyz", timeout=2).status_code == 200,
               "readyz")
    wait_until(lambda: candidate_sites(grid, "gw-a") == {"a", "b"}, "both sites at gateway a")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{p['gw-a']}/v1", api_key="unused",
                           max_retries=0, timeout=30)
    served = set()
    for i in range(30):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": f"hello {i}"}], max_tokens=4)
        assert raw.parse().choices[0].message.content
        served.add(raw.headers["x-gridd-served-by"])
    assert served == {"a/pool-a", "b/pool-b"}  # site b's requests went through b's gateway, pinned there
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=5, stream=True)
    chunks = [c for c in stream if c.choices and c.choices[0].delta.content]
    assert len(chunks) == 5
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    models = [m.id for m in client.models.list()]
    assert models == [MODEL]


def test_a_real_prometheus_scraping_one_operator_sees_both_sites(grid, tmp_path):
    """Spec: the operator exports grid_provider_* for its own providers and those it polls, "so
    a Prometheus scraping one hub sees every site". Debian's prometheus, on loopback, scrapes
    operator a only; its HTTP API must answer with both sites' series."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("the prometheus binary is absent (Debian package `prometheus`; scripts/bootstrap "
                    "installs it)")
    p = grid["ports"]
    [web] = free_ports(1)
    (tmp_path / "prometheus.yml").write_text(f"""
global: {{scrape_interval: 1s, scrape_timeout: 1s, evaluation_interval: 1s}}
scrape_configs:
  - job_name: gridd-operator-a
    static_configs: [{{targets: ["127.0.0.1:{p['met-a']}"]}}]
""")
    with open(tmp_path / "prometheus.log", "wb") as log:
        prom = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{web}"],
                                stdout=log, stderr=log)
        try:
            def series(query: str):
                r = httpx.get(f"http://127.0.0.1:{web}/api/v1/query", params={"query": query}, timeout=2)
                body = r.json()
                assert body["status"] == "success", body
                return {(s["metric"]["grid_site"], s["metric"]["grid_provider"]): s["value"][1]
                        for s in body["data"]["result"]}

            ready = wait_until(lambda: (s := series("grid_provider_ready")) and len(s) == 2 and s,
                               "prometheus holding both sites' grid_provider_ready", deadline_s=60)
            assert ready == {("a", "pool-a"): "1", ("b", "pool-b"): "1"}
            # Both sites' series came from the one target, operator a.
            r = httpx.get(f"http://127.0.0.1:{web}/api/v1/query", timeout=2, params={
                "query": 'count by (grid_site, job, instance) ({__name__=~"grid_provider_.+"})'}).json()
            assert sorted((s["metric"]["grid_site"], s["metric"]["job"], s["metric"]["instance"])
                          for s in r["data"]["result"]) == [
                ("a", "gridd-operator-a", f"127.0.0.1:{p['met-a']}"),
                ("b", "gridd-operator-a", f"127.0.0.1:{p['met-a']}")]
            r = httpx.get(f"http://127.0.0.1:{web}/api/v1/targets", timeout=2).json()
            scraped = [t["scrapeUrl"] for t in r["data"]["activeTargets"]]
            assert scraped == [f"http://127.0.0.1:{p['met-a']}/metrics"]
            values = httpx.get(f"http://127.0.0.1:{web}/api/v1/label/__name__/values", timeout=2)
            names = values.json()["data"]
            for name in ("grid_provider_ready", "grid_provider_ready_endpoints",
                         "grid_provider_in_flight_requests", "grid_provider_config_generation"):
                assert name in names
        finally:
            stop_processes([prom], grace_s=20)


def test_docs_metrics_lists_every_series_with_its_labels(grid):
    """docs/metrics.md against what a real operator and gateway expose (after traffic, so
    labelled families carry samples whose label names can be compared)."""
    p = grid["ports"]
    wait_until(lambda: candidate_sites(grid, "gw-a") == {"a", "b"}, "both sites at gateway a")
    for i in range(3):
        r = httpx.post(f"http://127.0.0.1:{p['gw-a']}/v1/chat/completions", timeout=30, json={
            "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": f"m{i}"}]})
        assert r.status_code == 200
    wait_until(lambda: "grid_probe_ticks_total{" in httpx.get(f"http://127.0.0.1:{p['met-a']}/metrics").text,
               "a probe tick")
    exposed: dict[str, list[set[str]]] = {}  # family -> the label names of each sample
    for port in (p["met-a"], p["gmet-a"]):
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        for family in text_string_to_metric_families(text):
            name = family.name + ("_total" if family.type == "counter" else "")
            exposed.setdefault(name, []).extend({k for k in s.labels if k != "le"} for s in family.samples)
    documented = {name: set(backticked(cells[1])) for name, cells in table_rows("metrics.md").items()}
    assert sorted(exposed) == sorted(documented)
    # Every sample carries exactly the documented label names (a family that had no sample
    # yet, say retries before any retry, is compared by name only).
    wrong = {name: labels for name, samples in exposed.items() for labels in samples
             if labels != documented[name]}
    assert wrong == {}
    with_samples = {name for name, samples in exposed.items() if samples}
    assert len(with_samples) >= 30, sorted(set(exposed) - with_samples)


def test_gridctl_explain_and_watch_on_a_running_grid(grid):
    def both_fresh():
        e = json.loads(gridctl(grid, "gw-a", "explain", MODEL, "--json").stdout)["explain"]
        return [c["signal"] for c in e["candidates"]] == ["fresh", "fresh"] and e
    e = wait_until(both_fresh, "both sites fresh at gateway a")
    assert e["outcome"]["kind"] == "forward" and e["pick_rule"] == "two_choices"
    chances = {f"{c['site']}/{c['provider']}": c["chance"] for c in e["candidates"]}
    assert sorted(chances) == ["a/pool-a", "b/pool-b"] and sum(chances.values()) == pytest.approx(1.0)
    assert {c["site"]: c["local"] for c in e["candidates"]} == {"a": True, "b": False}
    assert all(c["capacity"]["units"] == 2 and c["arrived_age_s"] is not None for c in e["candidates"])
    # status --json carries each candidate's signal state and age too.
    status = gridctl_json(grid, "gw-a")["role_status"]["candidates"]
    assert len(status) == 2
    assert all(c["signal"] in ("fresh", "stale", "silent") and c["age_s"] >= 0 for c in status)

    out = gridctl(grid, "gw-a", "explain", MODEL)
    assert out.returncode == 0, out.stderr
    print(out.stdout)
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"model       {MODEL}  (pick rule two_choices")
    assert lines[1].startswith("a request   forward: ")
    rows = {tuple(line.split()[:2]): line.split() for line in lines
            if line.split()[:2] in (["a", "pool-a"], ["b", "pool-b"])}
    assert set(rows) == {("a", "pool-a"), ("b", "pool-b")}
    shown = [float(row[-1].rstrip("%")) for row in rows.values()]
    assert sum(shown) == pytest.approx(100.0, abs=0.11)
    reasons = [line for line in lines if line.startswith(("a/pool-a: ", "b/pool-b: "))]
    assert len(reasons) == 2 and all("capacity" in r and "reading" in r for r in reasons)

    unknown = gridctl(grid, "gw-a", "explain", "no-such-model")
    assert unknown.returncode == 0
    assert f"404: no site serves 'no-such-model' (models here: {MODEL})" in unknown.stdout

    watched = gridctl(grid, "gw-a", "watch", "status", "--count", "2", "--interval", "0.5")
    assert watched.returncode == 0, watched.stderr
    assert watched.stdout.count("every 0.5s: gridctl status") == 2
    # stdout is not a terminal: no screen clearing
    assert watched.stdout.count("role        gateway") == 2 and "\x1b[2J" not in watched.stdout
    watched = gridctl(grid, "gw-a", "watch", "explain", MODEL, "--count", "1", "--json")
    assert watched.returncode == 0 and json.loads(watched.stdout)["explain"]["model"] == MODEL
    # A reader that goes away (`gridctl watch | head -1`) ends the watch quietly, no traceback.
    reader = subprocess.Popen([sys.executable, "-c",
                               "from gridd.cli import gridctl_main; raise SystemExit(gridctl_main())",
                               "--socket", str(grid["ws"] / "run" / "gw-a.sock"), "watch", "status",
                               "--interval", "0.2",
                               "--count", "50"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert reader.stdout.readline().startswith(b"every 0.2s: gridctl status")
    reader.stdout.close()
    assert reader.wait(timeout=30) == 0
    assert reader.stderr.read() == b""


def test_a_gateway_pointed_at_a_wrong_operator_port_is_degraded_and_answers_503_naming_the_cause(grid):
    """Issue 12, done when: a broken setup must not look like a wrong model name (404)."""
    ws = grid["ws"]
    http, wrong = free_ports(2)
    (ws / "gw-wrong.yaml").write_text(f"""
role: gateway
site: a
replica: g1
tls: {{ca: certs/ca.pem, cert: certs/a-gateway-g1.pem, key: certs/a-gateway-g1-key.pem}}
listen: {{http: "127.0.0.1:{http}"}}
control_socket: run/gw-wrong.sock
operator: {{url: "wss://127.0.0.1:{wrong}/signals"}}
""")
    with open(ws / "gw-wrong.log", "ab") as log:
        proc = gridd("run", "--config", str(ws / "gw-wrong.yaml"), log=log)
        try:
            status = wait_until(lambda: (s := gridctl_json(grid, "gw-wrong"))["state"] == "degraded" and s,
                                "the gateway to report degraded")
            role = status["role_status"]
            assert role["degraded"] == "no routing data from the operator: no poll has succeeded yet"
            assert role["operator_state"] == "down" and role["last_poll_error"].startswith("connect: ")
            human = gridctl(grid, "gw-wrong", "status").stdout
            assert "state       degraded" in human
            assert "degraded    no routing data from the operator: no poll has succeeded yet" in human

            r = httpx.post(f"http://127.0.0.1:{http}/v1/chat/completions", timeout=10, json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 503
            error = r.json()["error"]
            assert error["code"] == "no_routing_data"
            assert error["message"] == "no routing data from the operator: no poll has succeeded yet"
            assert int(r.headers["retry-after"]) >= 1
            ready = httpx.get(f"http://127.0.0.1:{http}/readyz", timeout=5)
            assert ready.status_code == 503 and "no routing data from the operator" in ready.text

            explained = gridctl(grid, "gw-wrong", "explain", MODEL)
            assert explained.returncode == 0
            assert ("a request   503 no_routing_data (no_operator_data): no routing data from the operator: "
                    "no poll has succeeded yet; Retry-After about 2 s") in explained.stdout
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=20) == 0
