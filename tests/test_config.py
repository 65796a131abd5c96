"""Config decoding: defaults, ${VAR} placeholders, and errors that name the exact path."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from gridd.config import config_from_env, default_control_socket, diff, load_config, parse_config
from gridd.errors import ConfigError

REPO = pathlib.Path(__file__).resolve().parent.parent

MINIMAL_OPERATOR = """
role: operator
site: a
providers:
  - name: llama
    model: m
    settings: {endpoint: "http://127.0.0.1:8088/v1"}
    metrics: {url: "http://127.0.0.1:8088/metrics"}
"""


def test_defaults_follow_design_section_5():
    cfg, _ = parse_config(MINIMAL_OPERATOR, env={})
    t = cfg.timings
    assert (t.scrape_interval_s, t.gateway_poll_interval_s, t.peer_poll_interval_s) == (1.0, 1.0, 5.0)
    assert (t.peer_poll_budget_s, t.signal_ttl_s, t.effective_stale_metrics_s) == (10.0, 20.0, 10.0)
    assert (t.latency_window_s, t.latency_min_completed, t.engine_answer_window_s) == (30.0, 20, 30.0)
    assert (t.future_epoch_bound_s, t.body_cap_bytes, t.scrape_concurrency) == (600.0, 1048576, 16)
    assert cfg.availability.shedding.enabled is False
    probe_defaults = parse_config(
        MINIMAL_OPERATOR.replace(
            'settings: {endpoint: "http://127.0.0.1:8088/v1"}',
            'settings: {endpoint: "http://127.0.0.1:8088/v1", probes: [{name: p, extract: [{json: a.b}]}]}',
        ),
        env={},
    )[0].providers[0].settings.probes[0]
    assert (probe_defaults.interval, probe_defaults.timeout, probe_defaults.max_series) == (10.0, 5.0, 200)
    assert (probe_defaults.aggregate.window, probe_defaults.aggregate.method) == (20, "mean")
    assert [s.to for s in probe_defaults.publish] == ["metadata"]


def test_stale_metrics_seconds_explicit_overrides_half_ttl():
    cfg, _ = parse_config(MINIMAL_OPERATOR + "timings: {signal_ttl_s: 30, stale_metrics_s: 4}\n", env={})
    assert cfg.timings.effective_stale_metrics_s == 4.0
    cfg, _ = parse_config(MINIMAL_OPERATOR + "timings: {signal_ttl_s: 30}\n", env={})
    assert cfg.timings.effective_stale_metrics_s == 15.0


PROBE_PROVIDERS = """
role: operator
site: a
providers:
  - {name: p0, model: m, settings: {endpoint: "http://h/v1"}}
  - {name: p1, model: m, settings: {endpoint: "http://h/v1"}}
  - name: p2
    model: m
    settings:
      endpoint: "http://h/v1"
      probes:
        - name: perf
          interval: INTERVAL
          extract: [{regex: 'vllm:(num_requests_waiting)\\{[^}]*\\}\\s+([0-9.eE+-]+)'}]
"""


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (PROBE_PROVIDERS.replace("INTERVAL", "-1"),
         "providers[2].settings.probes[0].interval: expected a number >= 0.1, got -1"),
        (PROBE_PROVIDERS.replace("INTERVAL", "soon"),
         "providers[2].settings.probes[0].interval: expected a number, got 'soon'"),
        ("role: operator\nsite: a\nbogus: 1\n", "bogus: unknown field"),
        ("role: operator\nsite: a\ntimings: {scrape_intervall_s: 1}\n", "timings.scrape_intervall_s: unknown field"),
        ("role: router\nsite: a\n", "role: expected one of 'gateway', 'operator', got 'router'"),
        ("site: a\n", "role: required field is missing"),
        ("role: operator\nsite: Site_A\n", "site: expected a string matching regex"),
        ("role: gateway\nsite: a\n", "operator: a gateway needs its operator's signals URL"),
        ("role: operator\nsite: a\nproviders:\n - {name: x, model: m, settings: {endpoint: 'http://h/v1'}}\n"
         " - {name: x, model: m, settings: {endpoint: 'http://h/v1'}}\n",
         "providers[1].name: duplicate provider name 'x'"),
        ("role: operator\nsite: a\npeers: [{site: a, url: 'wss://h:1/signals'}]\n",
         "peers[0].site: a peer cannot be this operator's own site 'a'"),
        ("role: operator\nsite: a\nproviders:\n - {name: x, model: m, settings: {endpoint: 'http://h/v1', "
         "probes: [{name: p, extract: [{regex: '(a)(b)', json: x}]}]}}\n",
         "providers[0].settings.probes[0].extract[0]: expected exactly one of 'regex' or 'json'"),
        ("role: operator\nsite: a\nproviders:\n - {name: x, model: m, settings: {endpoint: 'http://h/v1', "
         "probes: [{name: p, extract: [{regex: '(a'}]}]}}\n",
         "providers[0].settings.probes[0].extract[0].regex: invalid regular expression"),
        ("role: operator\nsite: a\nproviders:\n - {name: x, model: m, settings: {endpoint: 'http://h/v1', "
         "probes: [{name: p, extract: [{regex: 'a(b)'}]}]}}\n",
         "providers[0].settings.probes[0].extract[0].regex: expected two capture groups"),
        ("role: operator\nsite: a\nproviders:\n - {name: x, model: m, settings: {endpoint: 'ftp://h'}}\n",
         "providers[0].settings.endpoint: expected a string matching regex"),
        ("role: operator\nsite: a\nproviders:\n - {name: x, model: m, settings: {endpoint: 'http://h/v1', "
         "probes: [{name: p, extract: [{regex: '((a+)+)(b)'}]}]}}\n",
         "providers[0].settings.probes[0].extract[0].regex: a variable-length repeat inside an unbounded one"),
        ("role: operator\nsite: a\ntimings: {peer_poll_interval_s: 20}\n",
         "timings.peer_poll_budget_s: expected a budget at least as long as peer_poll_interval_s"),
        ("- just\n- a list\n", "(top level): expected a mapping, got a list"),
        ("role: operator\nsite: a\nproviders:\n - {name: x, model: m, settings: {endpoint: 'http://h/v1'}, "
         "metrics: {url: 'http://[::1/metrics'}}\n", "providers[0].metrics.url: not a usable URL"),
        ("role: operator\nsite: a\nproviders:\n - {name: x, model: m, settings: {endpoint: 'http://h/v1', "
         "auth: {scheme: bearer, api_key: 'clé'}}}\n",
         "providers[0].settings.auth.api_key: expected ASCII"),
        ("role: operator\n  site: [unclosed\n", "not valid YAML at line"),
        ("role: operator\nsite: a\nrouting: {strategy: fast}\n",
         "routing.strategy: expected one of the strategies' names (none defined), got 'fast'"),
        ("role: operator\nsite: a\nstrategies: [{name: p}]\nrouting: {model_strategies: {m: q}}\n",
         "routing.model_strategies.m: expected one of the strategies' names (p), got 'q'"),
        ("role: operator\nsite: a\nstrategies: [{name: p}, {name: p}]\n",
         "strategies[1].name: duplicate strategy name 'p'"),
        ("role: operator\nsite: a\nstrategies: [{name: p, provider_selector: {performance: {q: .inf}}}]\n",
         "strategies[0].provider_selector.performance.q: expected a finite bound, got inf"),
        ("role: operator\nsite: a\nrouting: {strategy_pick_rule: first}\n",
         "routing.strategy_pick_rule: expected one of 'strict', 'two_choices', got 'first'"),
        ("role: operator\nsite: a\nlisten: {http: '127.0.0.1:8080', http_reuse_port: true}\n",
         "listen.http_reuse_port: only gateways share a port"),
    ],
)
def test_errors_name_the_exact_path(text, message):
    with pytest.raises(ConfigError) as info:
        parse_config(text, env={})
    assert message in str(info.value)


def test_placeholders_resolve_from_the_environment():
    text = MINIMAL_OPERATOR.replace('"http://127.0.0.1:8088/v1"', '"http://${HOST}:8088/v1"')
    cfg, raw = parse_config(text, env={"HOST": "10.1.2.3"})
    assert cfg.providers[0].settings.endpoint == "http://10.1.2.3:8088/v1"
    # the raw tree keeps the placeholder as written (the providers API rewrites from it)
    assert raw["providers"][0]["settings"]["endpoint"] == "http://${HOST}:8088/v1"


def test_missing_placeholder_variable_is_named():
    text = MINIMAL_OPERATOR.replace('"http://127.0.0.1:8088/v1"', '"http://${GRIDD_TEST_UNSET_HOST}/v1"')
    with pytest.raises(ConfigError) as info:
        parse_config(text, env={})
    assert str(info.value) == (
        "providers[0].settings.endpoint: environment variable GRIDD_TEST_UNSET_HOST is not set "
        "(used as ${GRIDD_TEST_UNSET_HOST})"
    )


def test_placeholder_default():
    text = MINIMAL_OPERATOR.replace('"http://127.0.0.1:8088/v1"', '"http://${H:-localhost}:1/v1"')
    assert parse_config(text, env={})[0].providers[0].settings.endpoint == "http://localhost:1/v1"
    assert parse_config(text, env={"H": "x"})[0].providers[0].settings.endpoint == "http://x:1/v1"


def test_load_config_workspace_and_file_errors(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(MINIMAL_OPERATOR)
    loaded = load_config(path, env={})
    assert loaded.workspace == tmp_path
    assert loaded.resolve("var/state") == tmp_path / "var" / "state"
    assert loaded.resolve("/abs/x") == pathlib.Path("/abs/x")
    assert load_config(path, env={"GRIDD_WORKSPACE": "/srv/ws"}).workspace == pathlib.Path("/srv/ws")
    # spec 004's names are accepted too; gridd's own win when both are set
    assert load_config(path, env={"GATEWAY_WORKSPACE": "/srv/gw"}).workspace == pathlib.Path("/srv/gw")
    assert load_config(path, env={"GRIDD_WORKSPACE": "/srv/ws", "GATEWAY_WORKSPACE": "/srv/gw"}).workspace == (
        pathlib.Path("/srv/ws"))
    assert config_from_env({"GATEWAY_CONFIG": "/etc/g.yaml"}) == "/etc/g.yaml"
    assert config_from_env({"GRIDD_CONFIG": "/etc/a.yaml", "GATEWAY_CONFIG": "/etc/g.yaml"}) == "/etc/a.yaml"
    assert config_from_env({"GRIDD_CONFIG": ""}) is None
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml", env={})
    (tmp_path / "bin.yaml").write_bytes(b"role: \xff\xfe\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(tmp_path / "bin.yaml", env={})
    (tmp_path / "bad.yaml").write_text("role: operator\nsite: a\nbogus: 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "bad.yaml", env={})
    assert str(info.value) == f"{tmp_path / 'bad.yaml'}: bogus: unknown field (check spelling; see docs/config.md)"


def test_control_socket_path_resolution(tmp_path):
    cfg, _ = parse_config(MINIMAL_OPERATOR + "control_socket: run/g.sock\n", env={})
    assert default_control_socket(cfg, tmp_path, {}) == tmp_path / "run" / "g.sock"
    cfg, _ = parse_config(MINIMAL_OPERATOR, env={})
    assert default_control_socket(cfg, tmp_path, {"RUNTIME_DIRECTORY": "/run/x"}) == pathlib.Path("/run/x/gridd.sock")
    assert default_control_socket(None, None, {}) == pathlib.Path("/run/gridd/gridd.sock")


def test_diff_names_changed_sections():
    a, _ = parse_config(MINIMAL_OPERATOR, env={})
    b, _ = parse_config(MINIMAL_OPERATOR + "peers: [{site: b, url: 'wss://h:1/signals'}]\n", env={})
    assert diff(a, b) == {"peers"}
    assert diff(a, a) == set()


def test_check_config_broken_exit_2_names_path(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(PROBE_PROVIDERS.replace("INTERVAL", "-1"))
    proc = subprocess.run([sys.executable, "-m", "gridd", "check-config", str(bad)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "providers[2].settings.probes[0].interval: expected a number >= 0.1, got -1" in proc.stderr


def test_errors_show_values_as_written_never_resolved_from_the_environment():
    text = MINIMAL_OPERATOR + "timings: {scrape_interval_s: \"${SCRAPE_EVERY}\"}\n"
    with pytest.raises(ConfigError) as info:
        parse_config(text, env={"SCRAPE_EVERY": "hunter2-secret"})
    assert "hunter2-secret" not in str(info.value)
    assert str(info.value) == "timings.scrape_interval_s: expected a number, got '${SCRAPE_EVERY}'"
    bad_url = MINIMAL_OPERATOR.replace('"http://127.0.0.1:8088/metrics"', '"http://u:${PW}@[::1/metrics"')
    with pytest.raises(ConfigError) as info:
        parse_config(bad_url, env={"PW": "pa55word"})
    assert "pa55word" not in str(info.value)
