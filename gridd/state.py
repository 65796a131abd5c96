"""The operator's durable state directory: publisher-epoch high-water mark, provider revisions.

Every write is durable before it is relied on: write a temporary file, fsync it, rename it
over the old one, fsync the directory. Blocking file IO: call from a worker thread.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import secrets
from typing import Any

import msgspec

from gridd.config_schema import ProviderConfig
from gridd.errors import StateError

EPOCH_FILE = "publisher_epoch"
PROVIDERS_FILE = "providers.json"
API_TOKEN_FILE = "api-token"
"""The providers API's write token (docs/security.md): made at first start, mode 0600."""


def write_durably(path: pathlib.Path, data: bytes, *, mode: int | None = None) -> None:
    """``mode``: permission bits of the new file (default: the umask's). The temporary file
    gets them before any byte is written, so a secret is never readable more widely."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if mode is not None else 0o666)
        if mode is not None:
            os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as exc:
        raise StateError(f"{path}: cannot write state durably: {exc.strerror or exc}") from None


class EpochClaim(msgspec.Struct, frozen=True):
    """A claimed publisher epoch. discarded: the high-water mark left unclaimed because it
    was beyond the skew bound ahead of the clock (None when it was honoured)."""

    epoch: int
    discarded: int | None = None


class ProviderRevision(msgspec.Struct, frozen=True):
    uid: str
    generation: int
    spec_digest: str


def provider_spec_digest(provider: ProviderConfig) -> str:
    """Digest of the provider's spec. ``unavailable`` is administrative status and ``enabled``
    only pauses scraping, so neither advances the generation (status-only changes keep it)."""
    spec = msgspec.structs.replace(provider, unavailable=False, enabled=True)
    return hashlib.sha256(msgspec.json.encode(spec)).hexdigest()[:32]


class StateDir:
    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        try:
            path.mkdir(parents=True, exist_ok=True, mode=0o750)
        except OSError as exc:
            raise StateError(f"{path}: cannot create state directory: {exc.strerror or exc}") from None

    # -- publisher epoch ----------------------------------------------------------------

    def read_epoch_high_water(self) -> int:
        p = self.path / EPOCH_FILE
        try:
            text = p.read_text().strip()
        except FileNotFoundError:
            return 0
        except OSError as exc:
            raise StateError(f"{p}: cannot read epoch high-water mark: {exc.strerror or exc}") from None
        try:
            return int(text)
        except ValueError:
            raise StateError(f"{p}: epoch high-water mark is not an integer: {text[:40]!r}") from None

    def claim_publisher_epoch(self, wall_now: float, *, future_bound_s: float) -> EpochClaim:
        """DESIGN 5: the epoch is a wall-clock second count taken at operator start, forced
        above the persisted high-water mark, written durably before the first publication,
        so a restart never reuses or lowers it (even if the wall clock stepped back).

        Except a high-water mark more than ``future_bound_s`` (the receivers' skew bound,
        timings.future_epoch_bound_s) ahead of the clock: it is not claimed, and the epoch
        restarts from the clock. Every receiver whose clock agrees with ours drops an
        epoch that far ahead as skew, so claiming above it would lock this site out until
        the clock caught up (a clock that ran ahead, then was corrected). The trade-off,
        when it is the clock *now* that is wrong (set back further than the bound since
        the mark was claimed): receivers with a right clock still hold the higher epoch
        and drop this one as stale_order until the clock is fixed and the operator
        restarts (docs/wire.md, "Clock steps"). ``EpochClaim.discarded`` says it happened.
        """
        high_water = self.read_epoch_high_water()
        if high_water > wall_now + future_bound_s:
            claim = EpochClaim(int(wall_now), discarded=high_water)
        else:
            claim = EpochClaim(max(int(wall_now), high_water + 1))
        write_durably(self.path / EPOCH_FILE, f"{claim.epoch}\n".encode())
        return claim

    # -- the providers API's token ---------------------------------------------------------

    def api_token(self) -> str:
        """The providers API token: read from API_TOKEN_FILE, or created there (mode 0600,
        256 random bits) at first start. A file others may read is refused, not trusted:
        whoever could read it could write the providers."""
        p = self.path / API_TOKEN_FILE
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            fd = None
        except OSError as exc:
            raise StateError(f"{p}: cannot create the API token file: {exc.strerror or exc}") from None
        if fd is not None:
            token = secrets.token_urlsafe(32)
            with os.fdopen(fd, "w") as fh:
                fh.write(token + "\n")
                fh.flush()
                os.fsync(fh.fileno())
            return token
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd) as fh:
                mode = os.fstat(fh.fileno()).st_mode & 0o777
                token = fh.read().strip()
        except OSError as exc:
            raise StateError(f"{p}: cannot read the API token file: {exc.strerror or exc}") from None
        if mode & 0o077:
            raise StateError(f"{p}: the API token file has mode {mode:04o}; make it 0600 (chmod 600) "
                             "or delete it to have a new one made")
        if len(token) < 16:
            raise StateError(f"{p}: the API token file holds no usable token (under 16 characters); "
                             "delete it to have a new one made")
        return token

    # -- provider uid and generation -------------------------------------------------------

    def _read_revisions(self) -> dict[str, ProviderRevision]:
        p = self.path / PROVIDERS_FILE
        try:
            return msgspec.json.decode(p.read_bytes(), type=dict[str, ProviderRevision])
        except FileNotFoundError:
            return {}
        except (OSError, msgspec.DecodeError) as exc:
            raise StateError(f"{p}: unreadable provider revisions: {exc}") from None

    def sync_providers(self, providers: list[ProviderConfig]) -> dict[str, ProviderRevision]:
        """At start: the stored revisions brought up to this config, written durably when
        they changed (see plan_revisions)."""
        old = self._read_revisions()
        new = plan_revisions(old, providers)
        if new != old:
            self.write_revisions(new)
        return new

    def write_revisions(self, revisions: dict[str, ProviderRevision]) -> None:
        write_durably(self.path / PROVIDERS_FILE, msgspec.json.encode(revisions))


def plan_revisions(current: dict[str, ProviderRevision],
                   providers: list[ProviderConfig]) -> dict[str, ProviderRevision]:
    """The revisions ``providers`` get, from the ``current`` ones; nothing is written.

    Assign a random uid at creation and bump the generation on every spec change. A
    provider absent from the config is deleted here, so re-creating the same name later
    gets a new uid (spec: provider_uid identifies the object, including same-name
    recreations). A staged reload plans; only its commit writes (DESIGN 4: "a rejected
    reload changes and publishes nothing").
    """
    new: dict[str, ProviderRevision] = {}
    for provider in providers:
        digest = provider_spec_digest(provider)
        prev = current.get(provider.name)
        if prev is None:
            new[provider.name] = ProviderRevision(secrets.token_hex(8), 1, digest)
        elif prev.spec_digest != digest:
            new[provider.name] = ProviderRevision(prev.uid, prev.generation + 1, digest)
        else:
            new[provider.name] = prev
    return new


def state_summary(state: StateDir) -> dict[str, Any]:
    return {"path": str(state.path), "epoch_high_water": state.read_epoch_high_water()}


__all__ = ["EpochClaim", "StateDir", "ProviderRevision", "plan_revisions", "provider_spec_digest",
           "write_durably"]
