"""gridctl's human views: status for both roles, explain, and watch's redraw loop (the JSON views
are the daemon's answers as they are)."""

from __future__ import annotations

import io

import msgspec
from support import THREE_SITES, WALL, BatchFeed, load, store

from gridd.cli import CLEAR_SCREEN, format_explain, format_status, render_reply, watch_frames
from gridd.core.explain import explain_model

BASE = {"site": "a", "state": "serving", "pid": 7, "uptime_s": 12.0, "version": "0.1.0",
        "config_file": "/etc/gridd/x.yaml", "config_loaded_at": None,
        "last_reload": {"result": "error", "at": None, "error": "bogus: unknown field", "source": "SIGHUP"},
        "metrics": ["http://127.0.0.1:9100"], "tasks": ["signals", "scrape-pool"]}


def test_operator_view_lists_providers_and_peers():
    status = {**BASE, "role": "operator", "role_status": {
        "publisher_epoch": 1796000000, "stale_after_s": 10.0, "last_pass_s": 0.004,
        "providers": [
            {"name": "llama", "ready": False, "reason": "ScrapeFailed", "ready_endpoints": None,
             "in_flight": None, "kv_mean": None, "latency": None, "scrape_age_s": 0.4,
             "failure_class": "timeout"},
            {"name": "qwen", "ready": True, "reason": "EndpointsReady", "ready_endpoints": 4,
             "in_flight": 50.0,
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
                       {"model": "m", "site": "c", "provider": "pool-c", "age_s": 24.0, "signal": "stale",
                        "ready": True, "excluded": None, "rho": None, "capacity": 8.0},
                       {"model": "m", "site": "d", "provider": "pool-d", "age_s": 41.0, "signal": "silent",
                        "ready": True, "excluded": "silent", "rho": None, "capacity": 8.0}],
    }}
    text = format_status(status)
    assert "operator    wss://127.0.0.1:9443/signals  (up)" in text
    assert "shedding    m" in text
    rows = [line.split() for line in text.splitlines() if line.startswith("m ")]
    assert rows == [["m", "b", "pool-b", "3.2s", "fresh", "yes", "-", "0.50", "8.0"],
                    # A reading past the TTL is marked and shows no rho: it says nothing about now.
                    ["m", "c", "pool-c", "24.0s", "STALE", "yes", "-", "-", "8.0"],
                    ["m", "d", "pool-d", "41.0s", "SILENT", "yes", "silent", "-", "8.0"]]


# -- gridctl explain and watch ------------------------------------------------------------------

def explained(s, model="m", now=1.0) -> dict:
    return msgspec.to_builtins(explain_model(s, model, now=now))


def test_explain_view_lists_candidates_with_chances_and_one_reason_line_each():
    s, feed = store(), BatchFeed()
    s.ingest([feed.batch(site, ld=ld) for site, ld in THREE_SITES.items()]
             + [feed.batch("b", "old", ld=load(), age_s=25.0), feed.batch("c", "off", ready=False)],
             now=0.0, now_wall=WALL)
    text = format_explain(explained(s))
    lines = text.splitlines()
    assert lines[0] == "model       m  (pick rule two_choices, pending weight 4, signal TTL 20 s)"
    assert lines[1] == "a request   forward: a/llama 83.3%, c/llama 16.7%"
    assert lines[2] == ("shedding    off (availability.shedding.enabled: false): "
                        "an all-full model is forwarded, never 429")
    header = next(line for line in lines if line.startswith("SITE"))
    assert header.split() == ["SITE", "PROVIDER", "LOCAL", "SIGNAL", "AGE", "EXCLUDED", "TIER", "CAPACITY",
                              "IN-FLIGHT", "RHO", "FULL", "QUEUE", "PENDING", "CHANCE"]
    rows = [line.split() for line in lines[lines.index(header) + 1:] if line and "/" not in line.split()[0]]
    assert rows == [
        ["a", "llama", "yes", "fresh", "1.0s", "-", "room", "32.0", "prior", "4.0", "0.12", "no", "0.0", "-",
         "83.3%"],
        ["c", "llama", "no", "fresh", "1.0s", "-", "room", "16.0", "prior", "4.0", "0.25", "no", "0.0", "-",
         "16.7%"],
        ["b", "llama", "no", "fresh", "1.0s", "-", "room", "16.0", "prior", "8.0", "0.50", "no", "0.0", "-",
         "0.0%"],
        ["b", "old", "no", "STALE", "26.0s", "-", "stale", "16.0", "prior", "2.0", "-", "no", "0.0", "-",
         "0.0%"],
        ["c", "off", "no", "fresh", "1.0s", "not_ready", "-", "16.0", "prior", "2.0", "0.20", "no", "0.0",
         "-", "0.0%"],
    ]
    reasons = [line for line in lines if line.split() and "/" in line.split()[0]]
    assert [r.split(":")[0] for r in reasons] == ["a/llama", "c/llama", "b/llama", "b/old", "c/off"]
    assert reasons[3].startswith("b/old: stale: no fresh reading")
    assert reasons[4].startswith("c/off: excluded (not_ready): not ready")


def test_explain_view_names_503_429_and_404():
    s = store()
    assert format_explain(explained(s)).splitlines()[1] == (
        "a request   503 no_routing_data (no_operator_data): no routing data from the operator: no poll has "
        "succeeded yet; Retry-After about 2 s")
    feed = BatchFeed()
    s.ingest([feed.batch("a")], now=0.0, now_wall=WALL)
    assert format_explain(explained(s, "gpt-x")).splitlines()[1] == (
        "a request   404: no site serves 'gpt-x' (models here: m)")
    shed = store(shedding=True, full_after_s=2.0, room_after_s=5.0)
    full = load(ready=2, running=2.0, waiting=3.0, kv=1.0)
    for t in (0.0, 2.0):
        shed.ingest([feed.batch("a", ld=full)], now=t, now_wall=WALL)
    lines = format_explain(explained(shed, now=2.0)).splitlines()
    assert lines[1].startswith("a request   429 (shedding): ")
    assert lines[1].endswith("; Retry-After about 5 s")
    assert lines[2] == "shedding    on: SHEDDING (429) (next change in about 5 s)"
    assert next(line for line in lines if line.split()[:2] == ["a", "llama"]).split()[6] == "FULL"


def test_explain_on_an_operator_is_a_clear_error():
    assert render_reply("explain", {"ok": False, "error": "explain is a gateway command"}) == (
        "gridctl: explain is a gateway command")


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0
        self.sleeps: list[float] = []

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.t += s

    def __call__(self) -> float:
        return self.t


def test_watch_redraws_in_place_count_frames_on_schedule():
    clock, out = FakeClock(), io.StringIO()
    answers = iter([{"ok": True, "n": 1}, {"ok": True, "n": 2}, {"ok": True, "n": 3}])

    def fetch():
        clock.t += 0.25  # each answer takes 0.25 s: frames still start 2 s apart
        return next(answers)

    code = watch_frames(fetch, lambda r: f"frame {r['n']}", title="gridctl status", interval_s=2.0, count=3,
                        as_json=False, out=out, clear=True, sleep=clock.sleep, clock=clock, wall=lambda: 0.0)
    assert code == 0
    frames = out.getvalue().split(CLEAR_SCREEN)
    assert frames[0] == "" and len(frames) == 4
    assert [f.splitlines()[0].split("    ")[0] for f in frames[1:]] == ["every 2s: gridctl status"] * 3
    assert [f.splitlines()[2] for f in frames[1:]] == ["frame 1", "frame 2", "frame 3"]
    assert clock.sleeps == [1.75, 1.75]  # two sleeps between three frames, drift-free


def test_watch_without_a_terminal_or_as_json_does_not_clear_and_ctrl_c_exits_0():
    clock, out = FakeClock(), io.StringIO()

    def interrupted(s):
        raise KeyboardInterrupt

    code = watch_frames(lambda: {"ok": False, "error": "gone"}, lambda r: r["error"], title="t",
                        interval_s=1.0, count=None, as_json=True, out=out, clear=False, sleep=interrupted,
                        clock=clock)
    assert code == 0 and CLEAR_SCREEN not in out.getvalue()
    assert out.getvalue().splitlines()[0] == '{"error": "gone", "ok": false}'
    out = io.StringIO()
    code = watch_frames(lambda: {"ok": False, "error": "gone"}, lambda r: r["error"], title="t",
                        interval_s=1.0, count=2, as_json=False, out=out, clear=False, sleep=clock.sleep,
                        clock=clock)
    assert code == 1 and out.getvalue().count("every 1s: t") == 2 and CLEAR_SCREEN not in out.getvalue()
