"""Per-peer bounds on what a peer operator's batches may make this operator hold.

A peer with a valid certificate is trusted for its own site's readings, not for the size of
this operator's memory (docs/security.md). Before a peer's batch reaches the admission
fences, ``PeerIntake.take`` refuses it when

    name_length   its site or provider name is longer than NAME_MAX characters (a name
                  becomes a /metrics label and a key of every per-provider table);
    provider_cap  it names a provider this peer has not sent within the retention time,
                  and the peer already holds ``max_providers`` names here.

Names a peer stopped sending are forgotten ``retention`` after it last sent them
(``forget_unseen``; the operator uses 2 x the signal TTL, the same retention as a silent
peer's readings), and the caller drops their admission fences and readings with them, so
the state kept per peer stays bounded by the cap however many names it cycles through.

Pure: no IO; ``now`` (monotonic seconds) is passed in.
"""

from __future__ import annotations

from typing import Final, Literal

__all__ = ["INTAKE_REFUSALS", "NAME_MAX", "IntakeRefusal", "PeerIntake"]

NAME_MAX: Final = 255
"""Longest site or provider name taken from a peer (characters)."""

IntakeRefusal = Literal["name_length", "provider_cap"]
INTAKE_REFUSALS: Final[tuple[IntakeRefusal, ...]] = ("name_length", "provider_cap")


class PeerIntake:
    def __init__(self) -> None:
        # peer site -> provider name -> when the peer last sent a batch for it
        self._last_sent: dict[str, dict[str, float]] = {}

    def take(self, peer_site: str, site: str, provider: str, *, now: float,
             max_providers: int) -> IntakeRefusal | None:
        """None when a batch of ``peer_site`` for (site, provider) may go on to admission;
        else why it is refused. A batch claiming another site is left to admission, which
        drops it (identity) without keeping anything."""
        if len(site) > NAME_MAX or len(provider) > NAME_MAX:
            return "name_length"
        if site != peer_site:
            return None
        names = self._last_sent.setdefault(peer_site, {})
        if provider not in names and len(names) >= max_providers:
            return "provider_cap"
        names[provider] = now
        return None

    def forget_unseen(self, *, now: float, retention_s: float) -> list[tuple[str, str]]:
        """Forget names last sent more than ``retention_s`` ago; returns (site, provider)."""
        gone: list[tuple[str, str]] = []
        for site, names in self._last_sent.items():
            stale = [provider for provider, at in names.items() if now - at > retention_s]
            for provider in stale:
                del names[provider]
                gone.append((site, provider))
        return gone

    def held(self, peer_site: str) -> int:
        """Provider names of ``peer_site`` held now."""
        return len(self._last_sent.get(peer_site, {}))
