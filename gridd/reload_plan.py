"""What a reload can apply and what needs a restart: the one place that decides it.

A staged reload (SIGHUP, ``gridctl reload``, a providers API write) applies every change to
the running daemon except those to something opened once at start and held for the life of
the process. Those are refused, and the running config keeps serving:

    held by       setting                      why a reload cannot apply it
    daemon        role, site                   the role service and every identity are built for them
    daemon        listen.metrics               the metrics listener is bound at start
    daemon        control_socket               the control socket is bound at start
    both roles    listen.http                  the front / providers API listener is bound at start
    gateway       listen.http_reuse_port       a socket option of that listener
    both roles    limits.http_*                the listener's connection and body bounds
    operator      timings.scrape_concurrency   the scrape pool's limiter, the probes' limiter and
                                               the probes' HTTP pool are sized to it at start (the
                                               pool must never be the smaller)
    operator      listen.signals               the signals server is bound at start
    operator      tls added or removed         the signals server and peer pollers exist or not

``plan_reload`` starts from ``gridd.config.diff`` (the top-level sections that changed) and
looks inside only those. The daemon checks its own settings before staging the role; each
role checks its own in ``stage()`` after its config checks, so a reload is refused with the
first setting in the order above. The messages are the reload's answer, word for word.
Everything else is applied by ``commit()`` (peer and operator pollers restart only when their
peer, the trust domain or the TLS material changed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple

import msgspec

from gridd.config import diff, http_limits
from gridd.config_schema import Config
from gridd.errors import ConfigError

Holder = Literal["daemon", "operator", "gateway"]
"""What holds a setting open: the daemon itself, or the role service."""


class RestartNeeded(msgspec.Struct, frozen=True):
    holder: Holder
    setting: str
    message: str
    """The reload's answer, e.g. ``listen.http: changed; restart gridd to apply``."""


class _Rule(NamedTuple):
    sections: frozenset[str]
    """The top-level sections (``diff``) the setting lives in: unchanged, nothing to look at."""
    holders: frozenset[Holder]
    setting: str
    changed: Callable[[Config, Config], bool]
    message: Callable[[Config, Config], str]


def _rule(sections: str, holders: str, setting: str, changed: Callable[[Config, Config], bool],
          message: Callable[[Config, Config], str] | None = None) -> _Rule:
    held: frozenset[Holder] = frozenset(h for h in ("daemon", "operator", "gateway") if h in holders.split())
    return _Rule(frozenset(sections.split()), held, setting, changed,
                 message or (lambda old, new: f"{setting}: changed; restart gridd to apply"))


# In check order. The daemon's messages predate the roles' and read "<setting> changed"; the
# daemon prefixes them with the config file's path.
_RULES = (
    _rule("role site", "daemon", "role/site",
          lambda old, new: (old.role, old.site) != (new.role, new.site),
          lambda old, new: f"role/site changed ({old.role}/{old.site} -> {new.role}/{new.site}); "
                           "restart gridd to apply"),
    _rule("listen", "daemon", "listen.metrics", lambda old, new: old.listen.metrics != new.listen.metrics,
          lambda old, new: "listen.metrics changed; restart gridd to apply"),
    _rule("control_socket", "daemon", "control_socket",
          lambda old, new: old.control_socket != new.control_socket,
          lambda old, new: "control_socket changed; restart gridd to apply"),
    _rule("listen", "operator gateway", "listen.http", lambda old, new: old.listen.http != new.listen.http),
    _rule("listen", "gateway", "listen.http_reuse_port",
          lambda old, new: old.listen.http_reuse_port != new.listen.http_reuse_port),
    _rule("limits", "operator gateway", "limits.http_*",
          lambda old, new: http_limits(old) != http_limits(new)),
    _rule("timings", "operator", "timings.scrape_concurrency",
          lambda old, new: old.timings.scrape_concurrency != new.timings.scrape_concurrency),
    _rule("listen", "operator", "listen.signals", lambda old, new: old.listen.signals != new.listen.signals),
    _rule("tls", "operator", "tls", lambda old, new: (old.tls is None) != (new.tls is None),
          lambda old, new: "tls: added or removed; restart gridd to apply"),
)


class ReloadPlan(msgspec.Struct, frozen=True):
    changed: frozenset[str]
    """The top-level sections that differ (``gridd.config.diff``)."""
    restart_needed: tuple[RestartNeeded, ...]
    """Every holder's settings that changed and need a restart, in check order."""

    def held_by(self, holder: Holder) -> tuple[RestartNeeded, ...]:
        return tuple(need for need in self.restart_needed if need.holder == holder)

    def refuse_restart_changes(self, holder: Holder, *, config_file: str | None = None) -> None:
        """Raise ConfigError for the first of ``holder``'s settings that needs a restart, its
        message prefixed with ``config_file`` when given (the daemon's answers name the file)."""
        needs = self.held_by(holder)
        if needs:
            prefix = f"{config_file}: " if config_file is not None else ""
            raise ConfigError(prefix + needs[0].message)


def plan_reload(old: Config, new: Config) -> ReloadPlan:
    """What reloading from ``old`` to ``new`` would need a restart for (module docstring)."""
    changed = diff(old, new)
    needs = tuple(
        RestartNeeded(holder, rule.setting, rule.message(old, new))
        for rule in _RULES if rule.sections & changed and rule.changed(old, new)
        for holder in ("daemon", "operator", "gateway") if holder in rule.holders
    )
    return ReloadPlan(frozenset(changed), needs)
