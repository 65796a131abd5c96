"""gridd's configuration: one YAML file decoded into frozen msgspec Structs.

Loading is pure apart from reading the file and the environment: ``load_config`` returns a
``LoadedConfig`` or raises ``ConfigError`` whose message names the exact path of the bad
value and what was expected, e.g. ``providers[2].probes[0].interval: expected a number > 0,
got -1``. ``${VAR}`` placeholders resolve from the environment at load time; the raw tree
(placeholders as written) is kept so the providers API can rewrite the file faithfully.
Defaults follow DESIGN.md section 5; every knob is documented in docs/config.md.
"""

from __future__ import annotations

import math
import os
import pathlib
import re
import time
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import httpx
import msgspec
import msgspec.inspect
import yaml

from gridd.core.probes import regex_hazard
from gridd.errors import ConfigError

Positive = Annotated[float, msgspec.Meta(gt=0)]
NonNegative = Annotated[float, msgspec.Meta(ge=0)]
PositiveInt = Annotated[int, msgspec.Meta(gt=0)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
# Sites, providers and replicas appear in SAN URIs and metric labels: keep them tame.
Name = Annotated[str, msgspec.Meta(pattern=r"^[a-z0-9]([-a-z0-9.]{0,61}[a-z0-9])?$")]
ProbeName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
HostPort = Annotated[str, msgspec.Meta(pattern=r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):[0-9]{1,5}$")]
Url = Annotated[str, msgspec.Meta(pattern=r"^(https?|wss?)://\S+$")]


class Base(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


# -- credentials ---------------------------------------------------------------------------


class AuthConfig(Base):
    scheme: Literal["none", "bearer", "header"] = "none"
    api_key: str | None = None
    header_name: str = "authorization"
    custom_headers: dict[str, str] = msgspec.field(default_factory=dict)


def auth_headers(auth: AuthConfig) -> dict[str, str]:
    """The request headers an auth block sends: its custom headers, then the key under the
    scheme's header (``bearer``: ``Authorization: Bearer <key>``)."""
    headers = dict(auth.custom_headers)
    if auth.scheme == "bearer" and auth.api_key:
        headers["authorization"] = f"Bearer {auth.api_key}"
    elif auth.scheme == "header" and auth.api_key:
        headers[auth.header_name] = auth.api_key
    return headers


def url_origin(url: str) -> tuple[str, str, int | None]:
    """(scheme, host, port) with the scheme's default port filled in: what a secret is bound
    to (docs/security.md)."""
    u = httpx.URL(url)
    return u.scheme, u.host, u.port if u.port is not None else _DEFAULT_PORTS.get(u.scheme)


_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def credentials_for(url: str, own: AuthConfig | None, provider: ProviderConfig) -> dict[str, str]:
    """Headers for a metrics or probe request to ``url``. A secret is bound to the origin it
    was configured for: the URL's own auth block if it has one; else the provider's
    ``settings.auth`` when ``url`` has the origin of ``settings.endpoint``; else nothing."""
    if own is not None:
        return auth_headers(own)
    if url_origin(url) != url_origin(provider.settings.endpoint):
        return {}
    return auth_headers(provider.settings.auth)


# -- probes (spec 004) -------------------------------------------------------------------


class ExtractRule(Base):
    """Exactly one of ``regex`` (last group = value, the group before = name) or ``json``."""

    regex: str | None = None
    json: str | None = None


AggregateMethod = Literal[
    "latest", "mean", "median", "p50", "p90", "p95", "p99", "ewma", "min", "max", "stdev"
]


class AggregateConfig(Base):
    window: Annotated[int, msgspec.Meta(gt=0, le=10_000)] = 20
    method: AggregateMethod = "mean"


class PublishSink(Base):
    to: Literal["metadata", "file"]
    prefix: str = "attributes.probe"
    path: str | None = None
    max_entries: NonNegativeInt = 10000


class ProbeConfig(Base):
    name: ProbeName
    extract: list[ExtractRule]
    enabled: bool = True
    endpoint: Url | None = None
    auth: AuthConfig | None = None
    """Credentials for ``endpoint`` itself. Unset, the provider's ``settings.auth`` is sent
    only when the probe URL has the provider's own origin (docs/security.md)."""
    # Bounded: a probe is scrape load on the backend (spec: "keep interval sane"), and the
    # schedule arithmetic and memory must stay finite.
    interval: Annotated[float, msgspec.Meta(ge=0.1, le=86_400)] = 10.0
    timeout: Annotated[float, msgspec.Meta(gt=0, le=3_600)] = 5.0
    method: Literal["GET", "POST", "HEAD"] = "GET"
    aggregate: AggregateConfig = AggregateConfig()
    publish: list[PublishSink] = msgspec.field(default_factory=lambda: [PublishSink(to="metadata")])
    max_series: Annotated[int, msgspec.Meta(gt=0, le=10_000)] = 200


# -- providers ----------------------------------------------------------------------------


class ProviderSettings(Base):
    endpoint: Url
    """The OpenAI-compatible base (``.../v1``) requests are forwarded to."""
    timeout: Positive = 300.0
    auth: AuthConfig = AuthConfig()
    probes: list[ProbeConfig] = msgspec.field(default_factory=list)


class MetricsSource(Base):
    """Where the operator scrapes the provider's load signals (an EPP or a vLLM /metrics)."""

    url: Url
    kind: Literal["auto", "epp", "vllm"] = "auto"
    """What the URL serves: an llm-d EPP, a vLLM engine, or "auto" (told from the body). A
    body of the other flavour fails the scrape as ``wrong_kind``."""
    adapters: list[str] = msgspec.field(default_factory=list)
    """Further ``model_name`` values (LoRA adapters) whose EPP request rows count toward
    this provider's latency, besides its model."""
    auth: AuthConfig | None = None
    """Credentials for this URL (an EPP's --metrics-endpoint-auth token). Unset, the
    provider's ``settings.auth`` goes here only if ``url`` has the origin of
    ``settings.endpoint`` (docs/security.md)."""
    pool: str | None = None
    """The InferencePool ``name`` label to read; may be omitted when the EPP serves one pool."""
    timeout_s: Positive = 2.0
    queue_full_at: Positive | None = None
    """A serving unit whose waiting count reaches this is queue-full (shedding's test)."""


class ProviderMetadata(Base):
    labels: list[str] = msgspec.field(default_factory=list)
    cost: float = 0.0


class ProviderConfig(Base):
    name: Name
    model: str
    settings: ProviderSettings
    metrics: MetricsSource | None = None
    type: str = "hosted_vllm"
    enabled: bool = True
    unavailable: bool = False
    """Administrative state: an Unavailable provider is reported not ready."""
    metadata: ProviderMetadata = ProviderMetadata()


# -- peers, TLS, listeners ------------------------------------------------------------------


class PeerConfig(Base):
    site: Name
    url: Url
    """The peer operator's signals endpoint, ``wss://host:port/signals``."""
    ingress: Url | None = None
    """The peer site's gateways, where requests picked for that site are forwarded."""


class TLSConfig(Base):
    ca: str
    cert: str
    key: str


class ListenConfig(Base):
    metrics: HostPort | None = None
    signals: HostPort | None = None
    http: HostPort | None = None
    http_reuse_port: bool = False
    """Bind ``http`` with SO_REUSEPORT, so several gateway processes on one host (replicas,
    each with its own config and identity) share the front's port and the kernel spreads new
    connections over them (docs/performance.md, "All cores")."""


class OperatorLink(Base):
    url: Url


class ApiConfig(Base):
    admin_token: str | None = None
    """Bearer token the operator's providers API requires (docs/providers-api.md); unset or
    empty, the API serves only on a loopback ``listen.http``."""


class LimitsConfig(Base):
    """Bounds on what an outsider controls (docs/security.md). The http_* ones apply to the
    gateway's front and the operator's providers API, per listener; changing them needs a
    restart."""

    http_max_connections: PositiveInt = 1024
    http_body_deadline_s: Positive = 30.0
    http_max_buffered_bytes: PositiveInt = 16 * 1024 * 1024
    peer_max_providers: PositiveInt = 1000
    """Distinct provider names one peer operator's batches may hold at this operator."""


# -- routing knobs (docs/routing.md) ----------------------------------------------------------


class TimingConfig(Base):
    scrape_interval_s: Positive = 1.0
    scrape_concurrency: PositiveInt = 16
    body_cap_bytes: PositiveInt = 1024 * 1024
    gateway_poll_interval_s: Positive = 1.0
    gateway_poll_budget_s: Positive = 2.0
    """One gateway poll exchange (dial included) must finish within this."""
    peer_poll_interval_s: Positive = 5.0
    peer_poll_budget_s: Positive = 10.0
    signal_ttl_s: Positive = 20.0
    stale_metrics_s: Positive | None = None
    """staleMetricsSeconds; unset means half the signal TTL."""
    latency_window_s: Positive = 30.0
    latency_min_completed: PositiveInt = 20
    engine_answer_window_s: Positive = 30.0
    future_epoch_bound_s: Positive = 600.0

    @property
    def effective_stale_metrics_s(self) -> float:
        return self.stale_metrics_s if self.stale_metrics_s is not None else self.signal_ttl_s / 2


class SheddingConfig(Base):
    enabled: bool = False
    full_after_ms: PositiveInt = 5000
    room_after_ms: PositiveInt = 5000


class AvailabilityConfig(Base):
    shedding: SheddingConfig = SheddingConfig()


class RoutingConfig(Base):
    """Gateway routing knobs; docs/routing.md has each one's meaning and the measurements
    behind the defaults."""

    capacity_floor: Positive = 1.0
    rho_smoothing: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.5
    recent_window_s: Positive = 10.0
    unit_capacity: Positive = 8.0
    evidence_window_s: Positive = 60.0
    pick_rule: Literal["two_choices", "spec_tiers"] = "two_choices"
    pending_weight: Annotated[float, msgspec.Meta(ge=0, le=1000)] = 4.0
    candidate_retention_s: Positive = 600.0
    strategy: str | None = None
    """The strategy (a ``strategies[].name``) every model routes by unless
    ``model_strategies`` names another; unset: no strategy (docs/strategies.md)."""
    model_strategies: dict[str, str] = msgspec.field(default_factory=dict)
    """Model name -> strategy name: the model-to-strategy map; it overrides ``strategy``."""
    strategy_pick_rule: Literal["two_choices", "strict"] = "two_choices"
    """How a strategy picks among the candidates it keeps (decided in the probe scenario of
    the routing simulator, docs/performance.md)."""


class SortKey(Base):
    provider_attribute: str
    descending: bool = False


class StrategyConfig(Base):
    """A gateway strategy on probe metadata (spec 004's strategy.yaml; docs/strategies.md)."""

    name: str
    provider_selector: dict[str, dict[str, float]] = msgspec.field(default_factory=dict)
    """Upper bounds, ``{namespace: {name: bound}}``: a candidate whose ``namespace.name``
    value exceeds its bound is dropped."""
    sort: list[SortKey] = msgspec.field(default_factory=list)


class Config(Base):
    role: Literal["operator", "gateway"]
    site: Name
    trust_domain: str = "grid.local"
    replica: Name | None = None
    """A gateway's replica name (its SAN URI names it)."""
    tls: TLSConfig | None = None
    listen: ListenConfig = ListenConfig()
    control_socket: str | None = None
    state_dir: str = "var/state"
    drain_grace_s: Positive = 10.0
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    ingress: Url | None = None
    """This site's gateways, as advertised to peers for cross-site forwarding."""
    providers: list[ProviderConfig] = msgspec.field(default_factory=list)
    peers: list[PeerConfig] = msgspec.field(default_factory=list)
    operator: OperatorLink | None = None
    api: ApiConfig = ApiConfig()
    limits: LimitsConfig = LimitsConfig()
    timings: TimingConfig = TimingConfig()
    routing: RoutingConfig = RoutingConfig()
    availability: AvailabilityConfig = AvailabilityConfig()
    strategies: list[StrategyConfig] = msgspec.field(default_factory=list)


class LoadedConfig(msgspec.Struct, frozen=True, kw_only=True):
    config: Config
    raw: dict[str, Any]
    """The YAML tree as written, ``${VAR}`` placeholders unresolved."""
    path: pathlib.Path
    workspace: pathlib.Path
    loaded_at: float
    """Wall-clock time of the load."""

    def resolve(self, path: str) -> pathlib.Path:
        """A config-relative path resolves against the workspace, not the process CWD."""
        p = pathlib.Path(os.path.expanduser(path))
        return p if p.is_absolute() else self.workspace / p


# -- loading ----------------------------------------------------------------------------------

def placeholder_names(node: Any) -> set[str]:
    """Every ``${VAR}`` name used anywhere in a raw config tree."""
    if isinstance(node, str):
        return {m.group(1) for m in _PLACEHOLDER.finditer(node)}
    if isinstance(node, dict):
        return set().union(*(placeholder_names(v) for v in node.values())) if node else set()
    if isinstance(node, list):
        return set().union(*(placeholder_names(v) for v in node)) if node else set()
    return set()


_PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
"""``${VAR}`` (required) or ``${VAR:-default}`` (default when VAR is unset)."""


def _fmt_path(parts: list[str | int]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out or "(top level)"


def _substitute(node: Any, env: dict[str, str], parts: list[str | int]) -> Any:
    if isinstance(node, str):

        def repl(m: re.Match[str]) -> str:
            name, default = m.group(1), m.group(2)
            if name not in env:
                if default is not None:
                    return default
                raise ConfigError(
                    f"{_fmt_path(parts)}: environment variable {name} is not set (used as ${{{name}}})"
                )
            return env[name]

        return _PLACEHOLDER.sub(repl, node)
    if isinstance(node, dict):
        return {k: _substitute(v, env, [*parts, str(k)]) for k, v in node.items()}
    if isinstance(node, list):
        return [_substitute(v, env, [*parts, i]) for i, v in enumerate(node)]
    return node


_AT = re.compile(r"^(?P<what>.*?) - at `\$(?P<path>[^`]*)`$", re.S)
_PATH_PART = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]|\[\"?([^\]\"]*)\"?\]")


def _split_msgspec_path(path: str) -> list[str | int]:
    parts: list[str | int] = []
    for m in _PATH_PART.finditer(path):
        if m.group(1) is not None:
            parts.append(m.group(1))
        elif m.group(2) is not None:
            parts.append(int(m.group(2)))
        else:
            parts.append(m.group(3))
    return parts


def _lookup(tree: Any, parts: list[str | int]) -> tuple[bool, Any]:
    node = tree
    for part in parts:
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            return False, None
    return True, node


def _friendly(what: str) -> str:
    """msgspec's ``Expected `float` > 0`` -> ``expected a number > 0``."""
    what = what.replace("`float`", "a number").replace("`int`", "an integer")
    what = what.replace("`str`", "a string").replace("`bool`", "true or false")
    what = what.replace("`object`", "a mapping").replace("`array`", "a list").replace("`null`", "null")
    what = what.replace("`", "'")
    what = re.sub(r"\b(\d+)\.0\b", r"\1", what)
    return what[:1].lower() + what[1:]


def _allowed_values(parts: list[str | int]) -> list[Any]:
    """The Literal choices at a path of Config, for a readable 'expected one of' message."""
    info: Any = msgspec.inspect.type_info(Config)
    for part in [*parts, None]:
        while True:
            if isinstance(info, msgspec.inspect.Metadata):
                info = info.type
            elif isinstance(info, msgspec.inspect.UnionType):
                info = next(t for t in info.types if not isinstance(t, msgspec.inspect.NoneType))
            else:
                break
        if part is None:
            break
        if isinstance(info, msgspec.inspect.StructType):
            info = next(f.type for f in info.fields if f.name == part)
        elif isinstance(info, msgspec.inspect.ListType | msgspec.inspect.DictType):
            info = info.item_type if isinstance(info, msgspec.inspect.ListType) else info.value_type
    return list(getattr(info, "values", ()))


def _explain(err: msgspec.ValidationError, tree: Any) -> str:
    text = str(err)
    m = _AT.match(text)
    parts = _split_msgspec_path(m.group("path")) if m else []
    what = m.group("what") if m else text
    if what.startswith("Object contains unknown field"):
        field = what.split("`")[1]
        return f"{_fmt_path([*parts, field])}: unknown field (check spelling; see docs/config.md)"
    if what.startswith("Object missing required field"):
        field = what.split("`")[1]
        return f"{_fmt_path([*parts, field])}: required field is missing"
    found, value = _lookup(tree, parts)
    if what.startswith("Invalid enum value"):
        allowed = _allowed_values(parts)
        return f"{_fmt_path(parts)}: expected one of {', '.join(map(repr, allowed))}, got {value!r}"
    got = ""
    if found:
        # Show the offending value itself where it is a scalar; a mapping or list by its kind.
        what = what.split(", got `")[0]
        got = f", got a {type(value).__name__}" if isinstance(value, dict | list) else f", got {value!r}"
    return f"{_fmt_path(parts)}: {_friendly(what)}{got}"


def _check_semantics(cfg: Config) -> None:
    """Rules that span fields; each message names the path like the decoder's."""

    def fail(path: str, what: str) -> None:
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
            for where, text in (("api_key", auth.api_key), ("header_name", auth.header_name),
                                *((f"custom_headers.{k}", f"{k}: {v}") for k, v in auth.custom_headers.items())):
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
                if sink.to == "file" and ".." in pathlib.PurePath(sink.path).parts:
                    # Sinks live under the workspace (docs/security.md); the rest of the rule
                    # needs the workspace and is checked at start and reload (check_sink_paths).
                    fail(f"{where}.publish[{k}].path", "'..' is not allowed (file sinks live under the workspace)")
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
                    fail(f"strategies[{i}].provider_selector", "expected {namespace: {name: bound}} with non-empty names")
                if not math.isfinite(bound):
                    fail(f"strategies[{i}].provider_selector.{namespace}.{key}", f"expected a finite bound, got {bound!r}")
        for k, key in enumerate(strategy.sort):
            if not key.provider_attribute:
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


def parse_config(text: str, *, env: dict[str, str] | None = None, source: str = "<config>") -> tuple[Config, dict]:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{source}: not valid YAML{where}: {problem}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"(top level): expected a mapping, got a {type(raw).__name__}")
    resolved = _substitute(raw, dict(os.environ) if env is None else env, [])
    try:
        cfg = msgspec.convert(resolved, Config)
    except msgspec.ValidationError as exc:
        # The offending value is shown as written (placeholders unresolved): an error message
        # must never echo a value taken from the environment, which may be a secret.
        raise ConfigError(_explain(exc, raw)) from None
    _check_semantics(cfg)
    return cfg, raw


def load_config(path: str | os.PathLike[str], *, env: dict[str, str] | None = None) -> LoadedConfig:
    p = pathlib.Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read config: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: config is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    environ = dict(os.environ) if env is None else env
    try:
        cfg, raw = parse_config(text, env=environ, source=str(p))
    except ConfigError as exc:
        message = str(exc)
        raise ConfigError(message if message.startswith(f"{p}:") else f"{p}: {message}") from None
    named = workspace_from_env(environ)
    workspace = pathlib.Path(named) if named else p.resolve().parent
    return LoadedConfig(config=cfg, raw=raw, path=p.resolve(), workspace=workspace, loaded_at=time.time())


CONFIG_ENV = ("GRIDD_CONFIG", "GATEWAY_CONFIG")
"""Where the config file is named when no argument names it; the first set wins. The
second is spec 004's name (its examples use ``$GATEWAY_CONFIG``)."""
WORKSPACE_ENV = ("GRIDD_WORKSPACE", "GATEWAY_WORKSPACE")
"""The workspace (relative paths resolve against it), else the config file's directory;
the first set wins. The second is spec 004's name."""


def config_from_env(environ: Mapping[str, str]) -> str | None:
    return next((environ[name] for name in CONFIG_ENV if environ.get(name)), None)


def workspace_from_env(environ: Mapping[str, str]) -> str | None:
    return next((environ[name] for name in WORKSPACE_ENV if environ.get(name)), None)


def default_control_socket(cfg: Config | None, workspace: pathlib.Path | None, env: dict[str, str]) -> pathlib.Path:
    """The control socket: config, else $RUNTIME_DIRECTORY (systemd), else /run/gridd."""
    if cfg is not None and cfg.control_socket:
        p = pathlib.Path(cfg.control_socket)
        return p if p.is_absolute() or workspace is None else workspace / p
    runtime = env.get("RUNTIME_DIRECTORY", "").split(":")[0]
    return pathlib.Path(runtime or "/run/gridd") / "gridd.sock"


def http_limits(cfg: Config) -> dict[str, float | int]:
    """serve_asgi's keyword arguments for the bounds of ``limits`` (docs/security.md)."""
    lim = cfg.limits
    return {"max_connections": lim.http_max_connections, "body_deadline_s": lim.http_body_deadline_s,
            "max_buffered_bytes": lim.http_max_buffered_bytes}


def diff(old: Config, new: Config) -> set[str]:
    """Top-level sections that changed, so a reload restarts only what it must."""
    return {f for f in old.__struct_fields__ if getattr(old, f) != getattr(new, f)}
