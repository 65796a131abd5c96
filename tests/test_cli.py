"""gridctl's human status view for both roles (the JSON view is the daemon's status dict)."""

from __future__ import annotations

from gridd.cli import format_status

BASE = {"site": "a", "state": "serving", "pid": 7, "uptime_s": 12.0, "version": "0.1.0",
        "config_file": "/etc/gridd/x.yaml", "config_loaded_at": None,
        "last_reload": {"result": "error", "at": None, "error": "bogus: unknown field", "source": "SIGHUP"},
        "metrics": ["http://127.0.0.1:9100"], "tasks": ["signals", "scrape-pool"]}


def test_operator_view_lists_providers_and_peers():
    status = {**BASE, "role": "operator", "role_status": {
        "publisher_epoch": 1796000000, "stale_after_s": 10.0, "last_pass_s": 0.004,
        "providers": [
            {"name": "llama", "ready": False, "reason": "ScrapeFailed", "ready_endpoints": None, "in_flight": None,
             "kv_mean": None, "latency": None, "scrape_age_s": 0.4, "failure_class": "timeout"},
            {"name": "qwen", "ready": True, "reason": "EndpointsReady", "ready_endpoints": 4, "in_flight": 50.0,
             "kv_mean": 0.43, "kv_spread": 0.07, "scrape_age_s": 0.2, "failure_class": None,
             "latency": {"ttft_p50_s": 0.21, "ttft_p90_s": 0.38, "error_ratio": 0.01},
             "probes": [{"name": "perf", "state": "ok", "ticks": 12, "failures": {"timeout": 2}, "series": 3,
                         "last_success_age_s": 4.0}]},
        ],
        "gateway_feedback": {"conditions": [{"replica": "g1", "status": "True", "reason": "SkewRejected",
                                             "message": "gateway g1 rejected 3 batch(es)"}]},
        "peers": [{"site": "b", "state": "down", "last_success_age_s": 31.0, "last_error": "tls", "polls": 9,
                   "failures": 3, "url": "wss://b:9443/signals"}],
    }}
    text = format_status(status)
    assert "last reload error: bogus: unknown field" in text
    rows = {line.split()[0]: line.split() for line in text.splitlines()
            if line[:5] in ("llama", "qwen ") and line.split()[1] in ("yes", "NO", "unknown")}
    assert rows["llama"][1:3] == ["NO", "ScrapeFailed"] and rows["llama"][-1] == "timeout"
    assert rows["qwen"][1:6] == ["yes", "EndpointsReady", "4", "50.0", "0.43±0.07"]
    assert "0.210/0.380" in rows["qwen"]
    probe = next(line for line in text.splitlines() if line.startswith("qwen      perf"))
    assert probe.split() == ["qwen", "perf", "ok", "12", "2", "3", "4.0s"]
    gateway = next(line for line in text.splitlines() if line.startswith("g1 "))
    assert gateway.split()[:3] == ["g1", "True", "SkewRejected"]
    peer = next(line for line in text.splitlines() if line.startswith("b "))
    assert peer.split()[:4] == ["b", "down", "31.0s", "tls"]


def test_gateway_view_lists_candidates():
    status = {**BASE, "role": "gateway", "role_status": {
        "operator": "wss://127.0.0.1:9443/signals", "operator_state": "up", "last_poll_error": None,
        "front": ["http://127.0.0.1:8000"], "models": ["m"], "shedding": ["m"],
        "candidates": [{"model": "m", "site": "b", "provider": "pool-b", "age_s": 3.2, "signal": "fresh",
                        "ready": True, "excluded": None, "rho": 0.5, "capacity": 8.0},
                       {"model": "m", "site": "c", "provider": "pool-c", "age_s": 31.0, "signal": "stale",
                        "ready": True, "excluded": None, "rho": None, "capacity": 8.0}],
    }}
    text = format_status(status)
    assert "operator    wss://127.0.0.1:9443/signals  (up)" in text
    assert "shedding    m" in text
    rows = [line.split() for line in text.splitlines() if line.startswith("m ")]
    assert rows == [["m", "b", "pool-b", "3.2s", "fresh", "yes", "-", "0.50", "8.0"],
                    # A reading past the TTL is marked and shows no rho: it says nothing about now.
                    ["m", "c", "pool-c", "31.0s", "STALE", "yes", "-", "-", "8.0"]]
