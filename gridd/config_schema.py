"""gridd's configuration keys: the frozen msgspec Structs one YAML file decodes into.

Every key, its type, bounds and default is declared here (defaults follow DESIGN.md section 5;
every knob is documented in docs/config.md, and a test fails when the two disagree). Decoding
and the messages for bad values are gridd.config's; rules that span several keys are
gridd.config_rules'.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

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
    """Every config section: immutable, unknown keys refused, keywords only. Subclasses inherit
    all three; they repeat ``frozen=True`` because mypy does not carry it down."""


# -- credentials ---------------------------------------------------------------------------


class AuthConfig(Base, frozen=True):
    scheme: Literal["none", "bearer", "header"] = "none"
    api_key: str | None = None
    header_name: str = "authorization"
    custom_headers: dict[str, str] = msgspec.field(default_factory=dict)


# -- probes (spec 004) -------------------------------------------------------------------


class ExtractRule(Base, frozen=True):
    """Exactly one of ``regex`` (last group = value, the group before = name) or ``json``."""

    regex: str | None = None
    json: str | None = None


AggregateMethod = Literal[
    "latest", "mean", "median", "p50", "p90", "p95", "p99", "ewma", "min", "max", "stdev"
]


class AggregateConfig(Base, frozen=True):
    window: Annotated[int, msgspec.Meta(gt=0, le=10_000)] = 20
    method: AggregateMethod = "mean"


class PublishSink(Base, frozen=True):
    to: Literal["metadata", "file"]
    prefix: str = "attributes.probe"
    path: str | None = None
    max_entries: NonNegativeInt = 10000


class ProbeConfig(Base, frozen=True):
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


class ProviderSettings(Base, frozen=True):
    endpoint: Url
    """The OpenAI-compatible base (``.../v1``) requests are forwarded to."""
    timeout: Positive = 300.0
    auth: AuthConfig = AuthConfig()
    probes: list[ProbeConfig] = msgspec.field(default_factory=list)


class MetricsSource(Base, frozen=True):
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


class ProviderMetadata(Base, frozen=True):
    labels: list[str] = msgspec.field(default_factory=list)
    cost: float = 0.0


class ProviderConfig(Base, frozen=True):
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


class PeerConfig(Base, frozen=True):
    site: Name
    url: Url
    """The peer operator's signals endpoint, ``wss://host:port/signals``."""
    ingress: Url | None = None
    """The peer site's gateways, where requests picked for that site are forwarded."""


class TLSConfig(Base, frozen=True):
    ca: str
    cert: str
    key: str


class ListenConfig(Base, frozen=True):
    metrics: HostPort | None = None
    signals: HostPort | None = None
    http: HostPort | None = None
    http_reuse_port: bool = False
    """Bind ``http`` with SO_REUSEPORT, so several gateway processes on one host (replicas,
    each with its own config and identity) share the front's port and the kernel spreads new
    connections over them (docs/performance.md, "All cores")."""


class OperatorLink(Base, frozen=True):
    url: Url


class ApiConfig(Base, frozen=True):
    admin_token: str | None = None
    """Bearer token the operator's providers API requires (docs/providers-api.md); unset or
    empty, the API serves only on a loopback ``listen.http``."""


class LimitsConfig(Base, frozen=True):
    """Bounds on what an outsider controls (docs/security.md). The http_* ones apply to the
    gateway's front and the operator's providers API, per listener; changing them needs a
    restart."""

    http_max_connections: PositiveInt = 1024
    http_body_deadline_s: Positive = 30.0
    http_max_buffered_bytes: PositiveInt = 16 * 1024 * 1024
    peer_max_providers: PositiveInt = 1000
    """Distinct provider names one peer operator's batches may hold at this operator."""


# -- routing knobs (docs/routing.md) ----------------------------------------------------------


class TimingConfig(Base, frozen=True):
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


class SheddingConfig(Base, frozen=True):
    enabled: bool = False
    full_after_ms: PositiveInt = 5000
    room_after_ms: PositiveInt = 5000


class AvailabilityConfig(Base, frozen=True):
    shedding: SheddingConfig = SheddingConfig()


class RoutingConfig(Base, frozen=True):
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


class SortKey(Base, frozen=True):
    provider_attribute: str
    descending: bool = False


class StrategyConfig(Base, frozen=True):
    """A gateway strategy on probe metadata (spec 004's strategy.yaml; docs/strategies.md)."""

    name: str
    provider_selector: dict[str, dict[str, float]] = msgspec.field(default_factory=dict)
    """Upper bounds, ``{namespace: {name: bound}}``: a candidate whose ``namespace.name``
    value exceeds its bound is dropped."""
    sort: list[SortKey] = msgspec.field(default_factory=list)


class Config(Base, frozen=True):
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
