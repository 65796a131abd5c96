"""Spec 004 through real processes on loopback with real TLS: Example 1's provider, verbatim,
listed by a gateway and answering chat through it (launched with the seed's $GATEWAY_CONFIG /
$GATEWAY_WORKSPACE); the strategy.yaml semantics (a provider over the bound gets no request, the
others ranked, one without the value kept and used last); Example 2's providers-API flow run as
the spec's curl/jq commands, with gridd's port and a write token."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from realproc import Processes, gridctl, gridctl_status, wait_until

from gridd.childprocs import free_ports

pytestmark = pytest.mark.realproc
MODEL = "Qwen/Qwen3.5-9B"

# Spec 004, Example 1, verbatim (only the backend's port differs: 8088 is the simulator's).
EXAMPLE_1 = r"""providers:
  - name: local
    type: hosted_vllm
    model: Qwen/Qwen3.5-9B
    enabled: true
    metadata:
      labels: [local]
      cost: 0
    settings:
      endpoint: http://localhost:8088/v1            # chat base (/v1)
      timeout: 300.0
      auth:
        scheme: none
        api_key: null
        custom_headers: {}
      probes:
        - name: perf
          enabled: true
          endpoint: http://localhost:8088/metrics   # scrape target (NOT /v1)
          interval: 5
          timeout: 5
          extract:
            - regex: 'vllm:(num_requests_waiting)\{[^}]*\}\s+([0-9.eE+-]+)'
            - regex: 'vllm:(kv_cache_usage_perc)\{[^}]*\}\s+([0-9.eE+-]+)'
          aggregate: { window: 12, method: mean }
          publish:
            - { to: metadata, prefix: performance }          # → routing (live)
            - { to: file, path: probes/local.perf.jsonl }    # → history
"""

# Spec 004's strategy.yaml, verbatim.
STRATEGY_YAML = """# strategy.yaml
strategies:
  - name: performance_based
    provider_selector:
      performance:
        num_requests_waiting: 5     # drop providers with a longer queue
        kv_cache_usage_perc: 0.9    # drop providers whose KV cache is saturated
    sort:
      - { provider_attribute: performance.num_requests_waiting, descending: false }
"""

# Spec 004, Example 2, verbatim, except: gridd's providers API port for 8000, and the write
# token gridd requires on every POST (docs/providers-api.md).
EXAMPLE_2_POST = r"""curl -X POST http://localhost:8000/v1/providers/local \
  -H 'content-type: application/json' \
  -d '{
    "settings": {
      "endpoint": "http://localhost:8088/v1",
      "timeout": 300.0,
      "auth": {"scheme": "none", "api_key": null, "custom_headers": {}},
      "probes": [
        {
          "name": "perf",
          "enabled": true,
          "endpoint": "http://localhost:8088/metrics",
          "interval": 5,
          "extract": [
            {"regex": "vllm:(num_requests_waiting)\\{[^}]*\\}\\s+([0-9.eE+-]+)"}
          ],
          "publish": [
            {"to": "metadata", "prefix": "performance"},
            {"to": "file", "path": "probes/local.perf.jsonl"}
          ]
        }
      ]
    }
  }'
"""
EXAMPLE_2_CONFIRM = """curl -s http://localhost:8000/v1/providers/local | jq '.settings.probes'
"""
EXAMPLE_2_EDIT = r"""# 1. Define the probe to add.
read -r -d '' PROBE <<'JSON'
{
  "name": "perf",
  "enabled": true,
  "endpoint": "http://localhost:8088/metrics",
  "interval": 5,
  "extract": [{"regex": "vllm:(num_requests_waiting)\\{[^}]*\\}\\s+([0-9.eE+-]+)"}],
  "publish": [
    {"to": "metadata", "prefix": "performance"},
    {"to": "file", "path": "probes/local.perf.jsonl"}
  ]
}
JSON

# 2. GET current config, append the probe (replacing any probe of the same
#    name), and POST just the settings back.
curl -s http://localhost:8000/v1/providers/local \
  | jq --argjson probe "$PROBE" '{
      settings: (.settings + {
        probes: (((.settings.probes // []) | map(select(.name != $probe.name))) + [$probe])
      })
    }' \
  | curl -X POST http://localhost:8000/v1/providers/local \
      -H 'content-type: application/json' -d @-
"""


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    certs = tmp_path_factory.mktemp("certs")
    run = [sys.executable, "-m", "gridd", "certs"]
    assert subprocess.run([*run, "init", str(certs)], capture_output=True, timeout=60).returncode == 0
    for role in (["--role", "operator"], ["--role", "gateway", "--replica", "g1"]):
        assert subprocess.run([*run, "issue", "--site", "a", *role, str(certs)], capture_output=True,
                              timeout=60).returncode == 0
    return certs


def operator_head(certs: Path, p: dict[str, int], extra: str = "") -> str:
    return f"""role: operator
site: a
tls: {{ca: {certs}/ca.pem, cert: {certs}/a-operator.pem, key: {certs}/a-operator-key.pem}}
listen: {{metrics: "127.0.0.1:{p['met']}", signals: "127.0.0.1:{p['sig']}"{extra}}}
control_socket: run/op.sock
state_dir: state
"""


def gateway_config(certs: Path, p: dict[str, int], tail: str = "") -> str:
    return f"""role: gateway
site: a
replica: g1
tls: {{ca: {certs}/ca.pem, cert: {certs}/a-gateway-g1.pem, key: {certs}/a-gateway-g1-key.pem}}
listen: {{http: "127.0.0.1:{p['gw']}", metrics: "127.0.0.1:{p['gmet']}"}}
control_socket: run/gw.sock
operator: {{url: "wss://127.0.0.1:{p['sig']}/signals"}}
{tail}"""


def ports(*names: str) -> dict[str, int]:
    return dict(zip(names, free_ports(len(names)), strict=True))


def candidate(ws: Path, provider: str) -> dict | None:
    status = gridctl_status(ws / "run" / "gw.sock")
    if status is None:
        return None
    return next((c for c in status["role_status"]["candidates"] if c["provider"] == provider), None)


def chat(gw: int, i: int) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{gw}/v1/chat/completions", timeout=30,
                      json={"model": MODEL, "messages": [{"role": "user", "content": f"hi {i}"}],
                            "max_tokens": 2})


def test_example_1_verbatim_is_listed_and_answers_chat_through_a_gateway(certs, tmp_path):
    p = ports("sim", "sig", "met", "gw", "gmet")
    ws = tmp_path
    (ws / "conf").mkdir()
    # The config is outside the workspace: $GATEWAY_WORKSPACE decides where paths resolve.
    config = ws / "conf" / "operator.yaml"
    config.write_text(operator_head(certs, p) + EXAMPLE_1.replace("8088", str(p["sim"])))
    (ws / "gateway.yaml").write_text(gateway_config(certs, p))
    with Processes(ws) as procs:
        procs.start("sim", "sim", "--flavour", "vllm", "--model", MODEL, "--port", str(p["sim"]))
        procs.start("op", "run", env={"GATEWAY_CONFIG": str(config), "GATEWAY_WORKSPACE": str(ws)})
        procs.start("gw", "run", "--config", str(ws / "gateway.yaml"))
        base = f"http://127.0.0.1:{p['gw']}"
        wait_until(lambda: [m["id"] for m in httpx.get(f"{base}/v1/models", timeout=2).json()["data"]]
                   == [MODEL], "the gateway to list Example 1's model")
        for i in range(5):
            resp = chat(p["gw"], i)
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-gridd-served-by"] == "a/local"
            assert resp.json()["choices"][0]["message"]["content"]

        # Probe metadata on both roles, under the names the spec gives.
        op = gridctl_status(ws / "run" / "op.sock")["role_status"]["providers"][0]
        assert op["name"] == "local" and op["ready"] is None and op["reason"] == "NoMetricsSource"
        assert set(op["metadata"]) == {"performance.num_requests_waiting", "performance.kv_cache_usage_perc"}
        # The gateway holds what the operator published, one poll later: read both until they
        # agree (a probe tick between the two reads changes the values).
        def same_metadata():
            published = gridctl_status(ws / "run" / "op.sock")["role_status"]["providers"][0]["metadata"]
            held = candidate(ws, "local")
            return held if held["metadata"] == published else None
        cand = wait_until(same_metadata, "the gateway to hold the operator's probe metadata")
        assert cand["excluded"] is None
        assert all(0 <= age <= 20 for age in cand["metadata_age_s"].values())
        for sock in ("op", "gw"):
            text = gridctl(ws / "run" / f"{sock}.sock", "status").stdout
            assert "METADATA" in text and "performance.num_requests_waiting" in text, text

        # The JSONL history lands under the workspace, not next to the config file.
        history = ws / "probes" / "local.perf.jsonl"
        record = json.loads(wait_until(lambda: history.read_text().splitlines(), "the history file")[-1])
        assert (record["provider"], record["probe"]) == ("local", "perf")
        assert set(record["aggregates"]) == {"num_requests_waiting", "kv_cache_usage_perc"}
        assert not (ws / "conf" / "probes").exists()


def probed_provider(name: str, sim: int, waiting: bool = True) -> str:
    """A provider with no metrics block whose probe (every 1 s, the latest value) publishes the
    sim's waiting count (unless ``waiting`` is False) and KV use under performance.*."""
    rules = [r"'vllm:(kv_cache_usage_perc)\{[^}]*\}\s+([0-9.eE+-]+)'"]
    if waiting:
        rules.append(r"'vllm:(num_requests_waiting)\{[^}]*\}\s+([0-9.eE+-]+)'")
    extract = "\n".join(f"            - regex: {r}" for r in rules)
    return f"""  - name: {name}
    model: {MODEL}
    settings:
      endpoint: http://127.0.0.1:{sim}/v1
      probes:
        - name: perf
          endpoint: http://127.0.0.1:{sim}/metrics
          interval: 1
          extract:
{extract}
          aggregate: {{window: 1, method: latest}}
          publish: [{{to: metadata, prefix: performance}}]
"""


def hold_requests(sim: int, n: int) -> list[threading.Thread]:
    """n chat requests straight to a simulator, left waiting (its ttft is long) until it stops."""
    def one(i: int) -> None:
        try:
            httpx.post(f"http://127.0.0.1:{sim}/v1/chat/completions", timeout=120,
                       json={"model": MODEL, "messages": [{"role": "user", "content": f"hold {i}"}]})
        except httpx.HTTPError:
            pass  # the simulator stopped: the request is over

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def waiting_seen(ws: Path, provider: str, at_least: float) -> bool:
    cand = candidate(ws, provider)
    return cand is not None and cand["metadata"].get("performance.num_requests_waiting", -1) >= at_least


def served_by(gw: int, n: int) -> set[str]:
    out = set()
    for i in range(n):
        resp = chat(gw, i)
        assert resp.status_code == 200, resp.text
        out.add(resp.headers["x-gridd-served-by"])
    return out


def test_performance_based_drops_a_provider_over_the_bound_and_ranks_the_rest(certs, tmp_path):
    p = ports("busy", "calm", "bare", "sig", "met", "gw", "gmet")
    ws = tmp_path
    (ws / "operator.yaml").write_text(operator_head(certs, p) + "providers:\n"
                                      + probed_provider("busy", p["busy"])
                                      + probed_provider("calm", p["calm"])
                                      + probed_provider("bare", p["bare"], waiting=False))
    strategy = STRATEGY_YAML + "routing: {strategy: performance_based}\n"
    (ws / "gateway.yaml").write_text(gateway_config(certs, p, strategy))
    with Processes(ws) as procs:
        # busy: one engine, one sequence, and a first token after 10 minutes: what it is sent waits
        procs.start("busy", "sim", "--flavour", "vllm", "--model", MODEL, "--port", str(p["busy"]),
                    "--endpoints", "1", "--max-seqs", "1", "--ttft-s", "600")
        for name in ("calm", "bare"):
            procs.start(name, "sim", "--flavour", "vllm", "--model", MODEL, "--port", str(p[name]),
                        "--endpoints", "1")
        procs.start("op", "run", "--config", str(ws / "operator.yaml"))
        procs.start("gw", "run", "--config", str(ws / "gateway.yaml"))
        procs.sim_url("busy")
        hold_requests(p["busy"], 8)  # 1 running, 7 waiting > 5
        wait_until(lambda: waiting_seen(ws, "busy", 7) and candidate(ws, "calm") and candidate(ws, "bare"),
                   "the gateway to see busy's queue of 7")
        status = gridctl_status(ws / "run" / "gw.sock")["role_status"]
        assert status["strategies"] == {MODEL: "performance_based"}
        assert "performance.num_requests_waiting" not in candidate(ws, "bare")["metadata"]
        # busy is over the bound: never picked. calm (0 waiting) ranks before bare (no value:
        # kept, sorted last), and two choices among two always compares both.
        assert served_by(p["gw"], 20) == {"a/calm"}

        # calm's queue grows past the bound too: bare, without the value, is what is left.
        assert httpx.post(f"http://127.0.0.1:{p['calm']}/admin", json={"ttft_s": 600, "max_seqs": 1},
                          timeout=5).status_code == 200
        hold_requests(p["calm"], 8)
        wait_until(lambda: waiting_seen(ws, "calm", 6), "the gateway to see calm over the bound")
        assert served_by(p["gw"], 20) == {"a/bare"}
        assert 'grid_probe_ticks_total{grid_provider="busy"' in httpx.get(
            f"http://127.0.0.1:{p['met']}/metrics", timeout=5).text


def test_example_2_api_flow_starts_edits_and_stops_the_probe(certs, tmp_path):
    p = ports("sim", "sig", "met", "gw", "gmet", "api")
    ws = tmp_path
    # Example 1's provider before any probe; a metrics block keeps it published when the
    # probe stops (settings are replaced whole by the API; metrics is outside them).
    provider = EXAMPLE_1.split("      probes:\n")[0].replace("8088", str(p["sim"]))
    provider += f"    metrics: {{url: 'http://127.0.0.1:{p['sim']}/metrics'}}\n"
    (ws / "operator.yaml").write_text(operator_head(certs, p, f', http: "127.0.0.1:{p["api"]}"') + provider)
    (ws / "gateway.yaml").write_text(gateway_config(certs, p))

    def shell(script: str) -> str:
        script = (script.replace("localhost:8000", f"127.0.0.1:{p['api']}").replace("8088", str(p["sim"]))
                  .replace("curl -X POST",
                           'curl -sS --fail-with-body -X POST -H "authorization: Bearer $TOKEN"'))
        token = (ws / "state" / "api-token").read_text().strip()
        out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                             env={"PATH": "/usr/bin:/bin", "TOKEN": token})
        assert out.returncode == 0, out.stderr
        return out.stdout

    with Processes(ws) as procs:
        procs.start("sim", "sim", "--flavour", "vllm", "--model", MODEL, "--port", str(p["sim"]))
        procs.start("op", "run", "--config", str(ws / "operator.yaml"))
        procs.start("gw", "run", "--config", str(ws / "gateway.yaml"))
        wait_until(lambda: candidate(ws, "local") and candidate(ws, "local")["signal"] == "fresh",
                   "the gateway")
        assert candidate(ws, "local")["metadata"] == {}

        assert json.loads(shell(EXAMPLE_2_POST))["settings"]["probes"][0]["name"] == "perf"
        probes = json.loads(shell(EXAMPLE_2_CONFIRM))
        assert [q["name"] for q in probes] == ["perf"] and probes[0]["enabled"] is True
        wait_until(lambda: "performance.num_requests_waiting" in candidate(ws, "local")["metadata"],
                   "the probe's value at the gateway")
        history = ws / "probes" / "local.perf.jsonl"
        wait_until(lambda: history.read_text().splitlines(), "the history under the workspace")

        # Edit in place (GET + jq + POST): the probe of the same name is replaced, not doubled.
        shell(EXAMPLE_2_EDIT.replace('"interval": 5', '"interval": 2'))
        probes = json.loads(shell(EXAMPLE_2_CONFIRM))
        assert [(q["name"], q["interval"]) for q in probes] == [("perf", 2)]

        # Stop: POST again with the probe's enabled false (the same GET + jq + POST).
        shell(EXAMPLE_2_EDIT.replace('"enabled": true', '"enabled": false'))
        assert json.loads(shell(EXAMPLE_2_CONFIRM))[0]["enabled"] is False
        op = gridctl_status(ws / "run" / "op.sock")["role_status"]["providers"][0]
        assert op["probes"][0]["state"] == "disabled" and op["metadata"] == {}
        wait_until(lambda: candidate(ws, "local")["metadata"] == {}, "the value to leave the gateway")
        resp = chat(p["gw"], 0)
        assert resp.status_code == 200 and resp.headers["x-gridd-served-by"] == "a/local"
