"""The operator's side of the channel that is not the relay itself: the channel's metrics,
its per-connection limits, the config rules it needs, and the operator's TLS material.
"""

from __future__ import annotations

from typing import Final

import msgspec
from prometheus_client import CollectorRegistry, Counter

from gridd.config import LoadedConfig
from gridd.config_schema import Config, TimingConfig
from gridd.errors import ConfigError
from gridd.link.dial import parse_channel_url
from gridd.link.serve import ChannelLimits
from gridd.link.session import ChannelError
from gridd.tls import TLSMaterial, check_tls_material

# grid_signals_connections_refused_total{reason}: the channel's own refusals (tls,
# handshake, identity before any message) and the operator's (identity, forbidden,
# protocol, decode after the WebSocket opened).
REFUSAL_REASONS: Final = ("tls", "handshake", "identity", "forbidden", "protocol", "decode")


class ChannelMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.refused = Counter(
            "grid_signals_connections_refused",
            "Signals-channel connections refused, by reason.",
            ["reason"],
            registry=registry,
        )
        for reason in REFUSAL_REASONS:
            self.refused.labels(reason)
        self.unsendable = Counter(
            "grid_signals_unsendable_batches",
            "Held batches left out of an answer because the wire could not carry them.",
            registry=registry,
        )

    def count_unsendable(self) -> None:
        self.unsendable.inc()

    def count_refused(self, reason: str) -> None:
        self.refused.labels(reason if reason in REFUSAL_REASONS else "protocol").inc()


def check_channel_config(cfg: Config) -> None:
    """Rules of the signals channel a config must meet; ConfigError names the path."""
    if cfg.listen.signals is not None and cfg.tls is None:
        raise ConfigError("listen.signals: the signals channel is mutual TLS only; configure tls")
    if cfg.peers and cfg.tls is None:
        raise ConfigError("peers: polling peer operators needs tls (mutual TLS)")
    for i, peer in enumerate(cfg.peers):
        try:
            parse_channel_url(peer.url)
        except ChannelError:
            raise ConfigError(f"peers[{i}].url: expected a wss://host:port/path URL, "
                              f"got {peer.url!r}") from None


def channel_limits(timings: TimingConfig) -> ChannelLimits:
    """The server's per-connection policy: idle after 3x the longest poll interval."""
    longest = max(timings.peer_poll_interval_s, timings.gateway_poll_interval_s)
    return ChannelLimits(idle_s=3.0 * longest)


class OperatorTLS(msgspec.Struct, frozen=True):
    """Checked TLS material plus a digest of the three files, to tell a rotation apart."""

    material: TLSMaterial
    files_sha256: str


def load_operator_tls(loaded: LoadedConfig, now_wall: float) -> OperatorTLS | None:
    """Check the configured TLS material as an operator's (blocking; run in a thread)."""
    cfg = loaded.config
    if cfg.tls is None:
        return None
    cert, key, ca = (str(loaded.resolve(p)) for p in (cfg.tls.cert, cfg.tls.key, cfg.tls.ca))
    material = check_tls_material(cert, key, ca, now=now_wall, expected_site=cfg.site,
                                  expected_role="operator", expected_trust_domain=cfg.trust_domain)
    return OperatorTLS(material, material.files_sha256)
