"""gridd.reload_plan: the one place that decides what a reload applies and what needs a restart.

Every setting a reload cannot apply, for the holder that refuses it and with the reload's exact
answer; changes a reload applies need no restart; only sections config.diff() names are looked
into; the first setting in check order is the one refused."""

from __future__ import annotations

import pytest

from gridd.config import parse_config
from gridd.errors import ConfigError
from gridd.reload_plan import RestartNeeded, plan_reload

OPERATOR = """
role: operator
site: a
listen: {metrics: "127.0.0.1:9101", signals: "127.0.0.1:9200", http: "127.0.0.1:9300"}
control_socket: run/gridd.sock
tls: {ca: ca.pem, cert: op.pem, key: op.key}
peers: [{site: b, url: "wss://127.0.0.1:9201/signals"}]
"""

GATEWAY = """
role: gateway
site: a
replica: r1
operator: {url: "wss://127.0.0.1:9200/signals"}
listen: {metrics: "127.0.0.1:9102", http: "127.0.0.1:8080"}
tls: {ca: ca.pem, cert: gw.pem, key: gw.key}
"""


LIMITS = "limits.http_*: changed; restart gridd to apply"


def _config(text: str, extra: str = ""):
    return parse_config(text + extra, env={})[0]


@pytest.mark.parametrize(("base", "old", "new", "holder", "message"), [
    (OPERATOR, "", "", None, None),
    (OPERATOR, 'site: a\n', 'site: c\n', "daemon",
     "role/site changed (operator/a -> operator/c); restart gridd to apply"),
    (OPERATOR, '{metrics: "127.0.0.1:9101"', '{metrics: "127.0.0.1:9109"', "daemon",
     "listen.metrics changed; restart gridd to apply"),
    (OPERATOR, "control_socket: run/gridd.sock", "control_socket: run/other.sock", "daemon",
     "control_socket changed; restart gridd to apply"),
    (OPERATOR, 'http: "127.0.0.1:9300"', 'http: "127.0.0.1:9301"', "operator",
     "listen.http: changed; restart gridd to apply"),
    (OPERATOR, 'signals: "127.0.0.1:9200"', 'signals: "127.0.0.1:9209"', "operator",
     "listen.signals: changed; restart gridd to apply"),
    (GATEWAY, 'http: "127.0.0.1:8080"', 'http: "127.0.0.1:8081"', "gateway",
     "listen.http: changed; restart gridd to apply"),
    (GATEWAY, 'http: "127.0.0.1:8080"', 'http: "127.0.0.1:8080", http_reuse_port: true', "gateway",
     "listen.http_reuse_port: changed; restart gridd to apply"),
])
def test_each_held_setting_names_its_holder_and_the_reloads_answer(base, old, new, holder, message):
    plan = plan_reload(_config(base), _config(base.replace(old, new)))
    role = "operator" if base is OPERATOR else "gateway"
    for who in ("daemon", role):
        assert [n.message for n in plan.held_by(who)] == ([message] if who == holder else [])
    assert all(isinstance(n, RestartNeeded) and n.setting in n.message for n in plan.restart_needed)


@pytest.mark.parametrize(("extra", "holders", "message"), [
    ("limits: {http_max_connections: 10}\n", ("operator", "gateway"), LIMITS),
    ("limits: {http_body_deadline_s: 5}\n", ("operator", "gateway"), LIMITS),
    ("limits: {http_max_buffered_bytes: 1024}\n", ("operator", "gateway"), LIMITS),
    ("timings: {scrape_concurrency: 4}\n", ("operator",),
     "timings.scrape_concurrency: changed; restart gridd to apply"),
    # applied by a reload: no restart for anyone
    ("limits: {peer_max_providers: 10}\n", (), None),
    ("timings: {scrape_interval_s: 2}\n", (), None),
    ("routing: {pending_weight: 1}\n", (), None),
    ("trust_domain: other.local\n", (), None),
    ("log_level: debug\n", (), None),
])
def test_limits_and_timings_restart_only_what_holds_them(extra, holders, message):
    for base in (OPERATOR, GATEWAY):
        role = "operator" if base is OPERATOR else "gateway"
        plan = plan_reload(_config(base), _config(base, extra))
        assert plan.changed == {extra.split(":")[0]}
        assert [n.message for n in plan.held_by(role)] == ([message] if role in holders else [])
        assert plan.held_by("daemon") == ()


def test_tls_added_or_removed_needs_an_operator_restart():
    tls = "tls: {ca: ca.pem, cert: op.pem, key: op.key}\n"
    without_tls = (OPERATOR.replace(tls, "").replace('signals: "127.0.0.1:9200", ', "")
                   .replace('peers: [{site: b, url: "wss://127.0.0.1:9201/signals"}]\n', ""))
    plan = plan_reload(_config(without_tls), _config(without_tls, tls))
    assert [n.message for n in plan.held_by("operator")] == ["tls: added or removed; restart gridd to apply"]
    # other files for the same slots are a rotation, applied by the reload
    rotated = plan_reload(_config(OPERATOR), _config(OPERATOR.replace("op.pem", "op-2.pem")))
    assert rotated.changed == {"tls"} and rotated.restart_needed == ()


def test_the_first_setting_in_check_order_is_refused_and_the_daemon_names_its_file():
    old = _config(OPERATOR)
    moved_listeners = (OPERATOR.replace('signals: "127.0.0.1:9200"', 'signals: "127.0.0.1:9209"')
                       .replace('http: "127.0.0.1:9300"', 'http: "127.0.0.1:9301"'))
    new = _config(moved_listeners, "timings: {scrape_concurrency: 4}\n")
    plan = plan_reload(old, new)
    assert [n.setting for n in plan.held_by("operator")] == [
        "listen.http", "timings.scrape_concurrency", "listen.signals"]
    with pytest.raises(ConfigError, match=r"^listen\.http: changed; restart gridd to apply$"):
        plan.refuse_restart_changes("operator")
    plan.refuse_restart_changes("daemon")  # nothing of the daemon's changed
    moved = plan_reload(old, _config(OPERATOR.replace("run/gridd.sock", "run/x.sock")))
    with pytest.raises(ConfigError) as caught:
        moved.refuse_restart_changes("daemon", config_file="/etc/gridd/operator.yaml")
    assert str(caught.value) == "/etc/gridd/operator.yaml: control_socket changed; restart gridd to apply"
    assert caught.value.reason == "config"
