"""Config rules that span several keys, checked after decoding (gridd.config.parse_config).

Each failure is a ConfigError whose message names the path like the decoder's, e.g.
``providers[1].name: duplicate provider name 'b'``. Regular expressions are checked by the
core that runs them (gridd.core.probes.regex_hazard): the config calls the core, never the
other way round.
"""

from __future__ import annotations

import math
import pathlib
import re
from typing import NoReturn

import httpx

from gridd.config_schema import Config
from gridd.core.probes import regex_hazard
from gridd.errors import ConfigError


def check_config_rules(cfg: Config) -> None:
    """Rules that span fields; each message names the path like the decoder's."""

    def fail(path: str, what: str) -> NoReturn:
        raise ConfigError(f"{path}: {what}")

    if cfg.role == "gateway":
        if cfg.operator is None:
            fail("operator", "a gateway needs its operator's signals URL (operator.url)")
        if cfg.providers:
            fail("providers", "providers are configured on the operator, not on a gateway")
        if cfg.peers:
            fail("peers", "peers are configured on the operator, not on a gateway")
        if cfg.replica is None:
            fail("replica", "a gateway needs its replica name (its certificate's SAN URI names it)")
    if cfg.role == "operator" and cfg.operator is not None:
        fail("operator", "only a gateway names an operator")
    if cfg.role == "operator" and cfg.listen.http_reuse_port:
        fail("listen.http_reuse_port", "only gateways share a port (one operator per site)")
    def check_url(path: str, url: str | None) -> None:
        if url is None:
            return
        try:
            parsed = httpx.URL(url)
            if not parsed.host:
                raise httpx.InvalidURL("no host")
        except (httpx.InvalidURL, ValueError) as exc:
            fail(path, f"not a usable URL ({exc})")

    seen: set[str] = set()
    for i, p in enumerate(cfg.providers):
        check_url(f"providers[{i}].settings.endpoint", p.settings.endpoint)
        check_url(f"providers[{i}].metrics.url", p.metrics.url if p.metrics else None)
        auths = [(f"providers[{i}].settings.auth", p.settings.auth)]
        if p.metrics is not None and p.metrics.auth is not None:
            auths.append((f"providers[{i}].metrics.auth", p.metrics.auth))
        auths += [(f"providers[{i}].settings.probes[{j}].auth", probe.auth)
                  for j, probe in enumerate(p.settings.probes) if probe.auth is not None]
        for at, auth in auths:
            custom = ((f"custom_headers.{k}", f"{k}: {v}") for k, v in auth.custom_headers.items())
            for where, text in (("api_key", auth.api_key), ("header_name", auth.header_name), *custom):
                if text is not None and not text.isascii():
                    fail(f"{at}.{where}", "expected ASCII (it is sent in an HTTP header)")
        if p.name in seen:
            fail(f"providers[{i}].name", f"duplicate provider name {p.name!r}")
        seen.add(p.name)
        probe_names: set[str] = set()
        for j, probe in enumerate(p.settings.probes):
            where = f"providers[{i}].settings.probes[{j}]"
            if probe.name in probe_names:
                fail(f"{where}.name", f"duplicate probe name {probe.name!r} in this provider")
            probe_names.add(probe.name)
            check_url(f"{where}.endpoint", probe.endpoint)
            if not probe.extract:
                fail(f"{where}.extract", "expected at least one extract rule")
            for k, rule in enumerate(probe.extract):
                rwhere = f"{where}.extract[{k}]"
                if (rule.regex is None) == (rule.json is None):
                    fail(rwhere, "expected exactly one of 'regex' or 'json'")
                if rule.regex is not None:
                    try:
                        compiled = re.compile(rule.regex)
                    except re.error as exc:
                        fail(f"{rwhere}.regex", f"invalid regular expression: {exc}")
                    if compiled.groups < 2:
                        fail(f"{rwhere}.regex", "expected two capture groups (name, then value)")
                    hazard = regex_hazard(rule.regex)
                    if hazard is not None:
                        fail(f"{rwhere}.regex", hazard)
            for k, sink in enumerate(probe.publish):
                if sink.to == "file" and not sink.path:
                    fail(f"{where}.publish[{k}].path", "a file sink needs a path")
                if sink.to == "file" and sink.path and ".." in pathlib.PurePath(sink.path).parts:
                    # Sinks live under the workspace (docs/security.md); the rest of the rule
                    # needs the workspace and is checked at start and reload (check_sink_paths).
                    fail(f"{where}.publish[{k}].path",
                         "'..' is not allowed (file sinks live under the workspace)")
    peer_sites: set[str] = set()
    for i, peer in enumerate(cfg.peers):
        check_url(f"peers[{i}].url", peer.url)
        check_url(f"peers[{i}].ingress", peer.ingress)
        if peer.site == cfg.site:
            fail(f"peers[{i}].site", f"a peer cannot be this operator's own site {cfg.site!r}")
        if peer.site in peer_sites:
            fail(f"peers[{i}].site", f"duplicate peer site {peer.site!r}")
        peer_sites.add(peer.site)
    strategy_names: set[str] = set()
    for i, strategy in enumerate(cfg.strategies):
        if not strategy.name:
            fail(f"strategies[{i}].name", "expected a non-empty name")
        if strategy.name in strategy_names:
            fail(f"strategies[{i}].name", f"duplicate strategy name {strategy.name!r}")
        strategy_names.add(strategy.name)
        for namespace, bounds in strategy.provider_selector.items():
            for key, bound in bounds.items():
                if not namespace or not key:
                    fail(f"strategies[{i}].provider_selector",
                         "expected {namespace: {name: bound}} with non-empty names")
                if not math.isfinite(bound):
                    fail(f"strategies[{i}].provider_selector.{namespace}.{key}",
                         f"expected a finite bound, got {bound!r}")
        for k, sort_key in enumerate(strategy.sort):
            if not sort_key.provider_attribute:
                fail(f"strategies[{i}].sort[{k}].provider_attribute", "expected a metadata attribute name")
    known = f"one of the strategies' names ({', '.join(sorted(strategy_names)) or 'none defined'})"
    if cfg.routing.strategy is not None and cfg.routing.strategy not in strategy_names:
        fail("routing.strategy", f"expected {known}, got {cfg.routing.strategy!r}")
    for model, name in cfg.routing.model_strategies.items():
        if name not in strategy_names:
            fail(f"routing.model_strategies.{model}", f"expected {known}, got {name!r}")
    t = cfg.timings
    if t.peer_poll_budget_s < t.peer_poll_interval_s:
        fail("timings.peer_poll_budget_s", "expected a budget at least as long as peer_poll_interval_s")
