"""What ``gridd run`` would refuse, checked without running: ``gridd check-config``.

Decoding (gridd.config) catches bad values; this adds what the daemon checks when it starts:
listen addresses that parse, the role's own rules (the same functions the services call at
start and on every reload), and the TLS material, loaded and checked exactly as the service
loads it (files readable, key matches certificate, certificate chains to the CA and is valid
now, its identity names this role, site and replica). Every failure is a ConfigError whose
message names the config path and says how to fix it.
"""

from __future__ import annotations

from gridd.config import LoadedConfig
from gridd.config_schema import Config
from gridd.errors import ConfigError
from gridd.gateway.service import check_gateway_config, load_gateway_tls
from gridd.http.listeners import parse_bind
from gridd.operator.channel_setup import load_operator_tls
from gridd.operator.service import check_operator_config
from gridd.tls import TLSMaterialError


def check_listen(cfg: Config) -> None:
    """Each listen address parses as the server that binds it reads it: decoding checked the
    host:port shape, this the port range (0..65535; 0 lets the kernel pick, for tests)."""
    for key in ("metrics", "http", "signals"):
        bind = getattr(cfg.listen, key)
        if bind is None:
            continue
        try:
            parse_bind(bind)
        except ValueError as exc:
            raise ConfigError(f"listen.{key}: {exc}; write host:port with a port up to 65535, "
                              "e.g. 127.0.0.1:9100") from None


# What to do about each TLSMaterialError reason (gridd.tls); the message already names the file.
TLS_FIXES = {
    "unreadable": "make the file readable by gridd, or make it",
    "malformed": "the file must hold PEM (certificates) or a PEM private key; reissue with `gridd certs`",
    "key_mismatch": "use the key issued together with this certificate",
    "expired": "issue a new certificate (`gridd certs issue`)",
    "not_yet_valid": "check this host's clock, or issue a certificate valid now",
    "untrusted": "issue the certificate from the grid CA named in tls.ca, or point tls.ca at its issuer",
    "identity": "issue a certificate for this role, site and replica",
    "usage": "issue a certificate for this role (`gridd certs issue --role ...`)",
    "changed": "run check-config again once the files stop changing",
}


def _tls_hint(cfg: Config) -> str:
    replica = f" --replica {cfg.replica}" if cfg.role == "gateway" and cfg.replica else ""
    return f"gridd certs issue --site {cfg.site} --role {cfg.role}{replica} DIR"


def check_tls(loaded: LoadedConfig, now_wall: float) -> None:
    """Load and check the TLS material as the role's service does at start."""
    cfg = loaded.config
    if cfg.tls is None:
        return
    load = load_operator_tls if cfg.role == "operator" else load_gateway_tls
    try:
        load(loaded, now_wall)
    except TLSMaterialError as exc:
        by_file = {str(loaded.resolve(getattr(cfg.tls, k))): k for k in ("cert", "key", "ca")}
        key = by_file.get(exc.path or "", "cert")
        fix = TLS_FIXES.get(exc.reason, "fix the TLS material")
        if exc.reason in ("unreadable", "identity", "usage", "expired"):
            fix += ": gridd certs init DIR" if key == "ca" else f": {_tls_hint(cfg)}"
        raise ConfigError(f"tls.{key}: {exc}; {fix}") from None


def provider_notes(cfg: Config) -> list[str]:
    """One line per provider whose signals do not come from an EPP (spec 004 Example 1 routes
    such a provider on probes alone)."""
    notes = []
    for i, p in enumerate(cfg.providers):
        if p.metrics is not None or not p.enabled:
            continue
        probes = [q.name for q in p.settings.probes if q.enabled]
        how = (f"judged by its probes only ({', '.join(probes)})" if probes
               else "and no probes: it publishes no signal at all")
        notes.append(f"providers[{i}] ({p.name}): no metrics block: no readiness or load from an EPP; {how}")
    return notes


def check_runnable(loaded: LoadedConfig, now_wall: float) -> list[str]:
    """Raise ConfigError for what ``gridd run`` would refuse; return notes worth a line."""
    cfg = loaded.config
    check_listen(cfg)
    if cfg.role == "operator":
        check_operator_config(loaded)
    else:
        check_gateway_config(cfg)
    check_tls(loaded, now_wall)
    return provider_notes(cfg)
