"""Peer identity and TLS material for the signals channel (mutual TLS).

Identity. Every operator and gateway holds a certificate from the grid CA whose
subjectAltName carries exactly one SPIFFE-style URI naming it:

    spiffe://<trust-domain>/site/<site>/operator
    spiffe://<trust-domain>/site/<site>/gateway/<replica>

A peer is who its *verified* certificate's URI says it is; DNS names and IP addresses
in the certificate only help ordinary clients and play no part in authentication.

Names. A trust domain is 1-255 characters of [a-z0-9._-], starting and ending with a
letter or digit. A site or replica name is 1-63 characters of [a-z0-9.-], starting and
ending with a letter or digit (a DNS label, dots allowed so a host name can be a
replica name). Nothing else is accepted: no upper case, no percent-encoding, no query,
fragment, port or user part, no empty or trailing path segment.

Contexts. `server_context` and `client_context` return stdlib `ssl.SSLContext`s (TLS 1.2+,
trusting only the grid CA bundle, both sides presenting certificates) for trio.SSLStream
and httpx. Hostname checking is off on the client on purpose: the caller authenticates
the server by identity after the handshake:

    stream = trio.SSLStream(tcp, client_context(...), server_hostname=None)
    await stream.do_handshake()
    require_identity(peer_identity(stream), trust_domain=td, site="b", role="operator")

Staged reload. `check_tls_material` reads and checks the certificate, key and CA files
and builds both contexts; the daemon swaps them in only if it returns.

Errors. Every failure raised here is a `TLSError` with a `reason` that is a bounded
metric label:

    IdentityError     identity                    (bad URI, no/several URIs, wrong peer)
    TLSMaterialError  unreadable, malformed, key_mismatch, expired, not_yet_valid,
                      untrusted, identity, usage, changed        (+ .path: the file)
    PeerAuthError     untrusted, expired, not_yet_valid, no_certificate, rejected,
                      handshake                   (see peer_auth_error)

The tree derives from gridd.errors.GriddError.
"""

from __future__ import annotations

import datetime
import hashlib
import re
import ssl
from collections.abc import Mapping
from typing import Any, Literal, Protocol

import msgspec
from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID
from OpenSSL import crypto as openssl_crypto

from gridd.errors import GriddError

Role = Literal["operator", "gateway"]
ROLES: tuple[str, ...] = ("operator", "gateway")

_SCHEME = "spiffe://"
_TRUST_DOMAIN = re.compile(r"[a-z0-9](?:[a-z0-9._-]{0,253}[a-z0-9])?")
_NAME = re.compile(r"[a-z0-9](?:[a-z0-9.-]{0,61}[a-z0-9])?")


class TLSError(GriddError):
    """Base of the TLS/identity errors; `reason` is a short, bounded metric label."""

    reason: str = "tls"


class IdentityError(TLSError):
    """A URI or certificate does not name a valid peer, or names the wrong one."""

    reason = "identity"


class TLSMaterialError(TLSError):
    """Certificate, key or CA files that cannot be used; `path` names the file at fault."""

    def __init__(self, message: str, *, reason: str, path: str | None = None) -> None:
        super().__init__(message, reason=reason)
        self.path = path


class PeerAuthError(TLSError):
    """A mutual-TLS handshake failed on certificates (see `peer_auth_error`)."""


def is_valid_name(name: str) -> bool:
    """True if `name` is usable as a site or replica name."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


def is_valid_trust_domain(trust_domain: str) -> bool:
    return isinstance(trust_domain, str) and _TRUST_DOMAIN.fullmatch(trust_domain) is not None


class PeerIdentity(msgspec.Struct, frozen=True):
    """Who a verified peer is. Constructing one validates it (IdentityError otherwise)."""

    trust_domain: str
    site: str
    role: Role
    replica: str | None = None

    def __post_init__(self) -> None:
        if not is_valid_trust_domain(self.trust_domain):
            raise IdentityError(f"invalid trust domain {self.trust_domain!r}")
        if not is_valid_name(self.site):
            raise IdentityError(f"invalid site name {self.site!r}")
        if self.role == "operator":
            if self.replica is not None:
                raise IdentityError("an operator identity has no replica")
        elif self.role == "gateway":
            if self.replica is None or not is_valid_name(self.replica):
                raise IdentityError(f"invalid gateway replica name {self.replica!r}")
        else:
            raise IdentityError(f"invalid role {self.role!r} (want operator or gateway)")

    @property
    def uri(self) -> str:
        base = f"{_SCHEME}{self.trust_domain}/site/{self.site}/{self.role}"
        return base if self.replica is None else f"{base}/{self.replica}"


def parse_identity_uri(uri: str) -> PeerIdentity:
    """Parse a SAN URI of the two accepted forms; anything else raises IdentityError."""
    if not isinstance(uri, str):
        raise IdentityError(f"identity URI must be a string, got {type(uri).__name__}")
    if not uri.startswith(_SCHEME):
        raise IdentityError(f"not a spiffe:// identity URI: {uri!r}")
    # Splitting on "/" is the whole grammar: every segment is then matched against a
    # character class that excludes ':', '@', '?', '#', '%' and whitespace, so ports,
    # user parts, queries, fragments, escapes and junk fail without special cases.
    parts = uri[len(_SCHEME) :].split("/")
    trust_domain = parts[0]
    if not is_valid_trust_domain(trust_domain):
        raise IdentityError(f"invalid trust domain in {uri!r}")
    role: Role
    match parts[1:]:
        case ["site", site, "operator"]:
            role, replica = "operator", None
        case ["site", site, "gateway", replica]:
            role = "gateway"
        case _:
            raise IdentityError(
                f"identity URI {uri!r} is not .../site/<site>/operator or .../site/<site>/gateway/<replica>"
            )
    return PeerIdentity(trust_domain, site, role, replica)


def _spiffe_uris(uris: list[str]) -> list[str]:
    # The scheme is compared case-insensitively here so that "SPIFFE://..." counts as a
    # (rejected) claim rather than being silently ignored as some other URI.
    return [u for u in uris if u[: len(_SCHEME)].lower() == _SCHEME]


def _cert_uris(cert: x509.Certificate) -> list[str]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return list(san.get_values_for_type(x509.UniformResourceIdentifier))


def identity_from_certificate(cert: bytes | Mapping[str, Any] | x509.Certificate | None) -> PeerIdentity:
    """The identity named by a *verified* peer certificate.

    Accepts DER bytes (`getpeercert(binary_form=True)`), the dict form of
    `getpeercert()`, or a cryptography certificate. The certificate must carry exactly
    one spiffe:// URI SAN (other URIs are ignored). This does not verify anything: pass
    only certificates that a CERT_REQUIRED handshake against the grid CA accepted.
    """
    if cert is None or (isinstance(cert, bytes | bytearray | Mapping) and not cert):
        raise IdentityError("peer presented no certificate")
    if isinstance(cert, Mapping):
        uris = [value for kind, value in cert.get("subjectAltName", ()) if kind == "URI"]
    else:
        if isinstance(cert, bytes | bytearray):
            try:
                cert = x509.load_der_x509_certificate(bytes(cert))
            except ValueError as exc:
                raise IdentityError(f"peer certificate is not valid DER: {exc}") from exc
        try:
            uris = _cert_uris(cert)
        except ValueError as exc:
            raise IdentityError(f"peer certificate has an unreadable subjectAltName: {exc}") from exc
    claims = _spiffe_uris(uris)
    if not claims:
        raise IdentityError("peer certificate carries no spiffe:// URI SAN")
    if len(claims) > 1:
        raise IdentityError(f"peer certificate carries {len(claims)} spiffe:// URI SANs, want exactly one")
    return parse_identity_uri(claims[0])


class _HasPeerCert(Protocol):
    def getpeercert(self, binary_form: bool = ...) -> Any: ...


def peer_identity(tls: _HasPeerCert) -> PeerIdentity:
    """Identity of the peer of a completed handshake.

    `tls` is anything with `getpeercert`: trio.SSLStream, ssl.SSLObject (httpx:
    `response.extensions["network_stream"].get_extra_info("ssl_object")`), ssl.SSLSocket.
    """
    return identity_from_certificate(tls.getpeercert(binary_form=True))


def require_identity(
    identity: PeerIdentity,
    *,
    trust_domain: str,
    site: str | None = None,
    role: Role | None = None,
) -> PeerIdentity:
    """Return `identity` if it is in `trust_domain` (and `site`/`role` when given), else raise.

    Callers state who they expect: a gateway requires its own site's operator; an
    operator accepts feedback only from gateways of its own site; a peer poller expects
    the operator of the peer's configured site.
    """
    if identity.trust_domain != trust_domain:
        raise IdentityError(f"peer {identity.uri} is outside trust domain {trust_domain!r}")
    if site is not None and identity.site != site:
        raise IdentityError(f"peer {identity.uri} is not of site {site!r}")
    if role is not None and identity.role != role:
        raise IdentityError(f"peer {identity.uri} is not a {role}")
    return identity


def declared_trust_domain(ca_cert: x509.Certificate) -> str | None:
    """The trust domain a CA certificate declares by a bare `spiffe://<td>` URI SAN, if any."""
    for uri in _spiffe_uris(_cert_uris(ca_cert)):
        rest = uri[len(_SCHEME) :]
        if is_valid_trust_domain(rest):
            return rest
    return None


# OpenSSL X509_V_ERR_* codes used to tell expiry apart from other verification failures.
_X509_V_ERR_CERT_NOT_YET_VALID = 9
_X509_V_ERR_CERT_HAS_EXPIRED = 10

# Alerts a peer sends when it refuses *our* certificate (OpenSSL reason strings).
_REJECTED_BY_PEER = frozenset(
    {
        "TLSV13_ALERT_CERTIFICATE_REQUIRED",
        "TLSV1_ALERT_UNKNOWN_CA",
        "TLSV1_ALERT_ACCESS_DENIED",
        "SSLV3_ALERT_BAD_CERTIFICATE",
        "SSLV3_ALERT_CERTIFICATE_EXPIRED",
        "SSLV3_ALERT_CERTIFICATE_REVOKED",
        "SSLV3_ALERT_CERTIFICATE_UNKNOWN",
        "SSLV3_ALERT_UNSUPPORTED_CERTIFICATE",
    }
)


def peer_auth_error(exc: BaseException) -> PeerAuthError | None:
    """Map a failed handshake (e.g. trio.BrokenResourceError caused by ssl.SSLError) to a reason.

    untrusted / expired / not_yet_valid: we refused the peer's certificate;
    no_certificate: the peer sent none; rejected: the peer refused ours;
    handshake: any other TLS failure. Returns None if no ssl.SSLError is in the chain.
    """
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, ssl.SSLCertVerificationError):
            code = cur.verify_code
            reason = {
                _X509_V_ERR_CERT_HAS_EXPIRED: "expired",
                _X509_V_ERR_CERT_NOT_YET_VALID: "not_yet_valid",
            }.get(code, "untrusted")
            return PeerAuthError(f"peer certificate refused: {cur.verify_message}", reason=reason)
        if isinstance(cur, ssl.SSLError):
            ssl_reason = getattr(cur, "reason", None) or ""
            if ssl_reason == "PEER_DID_NOT_RETURN_A_CERTIFICATE":
                return PeerAuthError("peer presented no certificate", reason="no_certificate")
            if ssl_reason in _REJECTED_BY_PEER:
                return PeerAuthError(f"peer refused our certificate ({ssl_reason})", reason="rejected")
            return PeerAuthError(f"TLS handshake failed: {cur}", reason="handshake")
        cur = cur.__cause__ or cur.__context__
    return None


def _load_own_certificate(ctx: ssl.SSLContext, cert_file: str, key_file: str) -> None:
    try:
        ctx.load_cert_chain(cert_file, key_file)
    except FileNotFoundError as exc:
        raise TLSMaterialError(f"{exc.filename}: not found", reason="unreadable", path=exc.filename) from exc
    except ssl.SSLError as exc:
        if getattr(exc, "reason", None) == "KEY_VALUES_MISMATCH":
            raise TLSMaterialError(
                f"{key_file}: private key does not match certificate {cert_file}",
                reason="key_mismatch",
                path=key_file,
            ) from exc
        raise TLSMaterialError(
            f"{cert_file} / {key_file}: cannot load certificate and key: {exc}",
            reason="malformed",
            path=cert_file,
        ) from exc
    except OSError as exc:
        raise TLSMaterialError(
            f"{exc.filename or cert_file}: {exc.strerror}",
            reason="unreadable",
            path=exc.filename or cert_file,
        ) from exc


def _load_ca(ctx: ssl.SSLContext, ca_file: str) -> None:
    try:
        ctx.load_verify_locations(cafile=ca_file)
    except FileNotFoundError as exc:
        raise TLSMaterialError(f"{ca_file}: not found", reason="unreadable", path=ca_file) from exc
    except ssl.SSLError as exc:
        raise TLSMaterialError(
            f"{ca_file}: cannot load CA bundle: {exc}", reason="malformed", path=ca_file
        ) from exc
    except OSError as exc:
        raise TLSMaterialError(f"{ca_file}: {exc.strerror}", reason="unreadable", path=ca_file) from exc


def server_context(cert_file: str, key_file: str, ca_file: str) -> ssl.SSLContext:
    """Server side of the signals channel: TLS 1.2+, a client certificate from the grid CA required."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.verify_mode = ssl.CERT_REQUIRED
    _load_own_certificate(ctx, cert_file, key_file)
    _load_ca(ctx, ca_file)  # the grid CA only: no system trust store
    return ctx


def client_context(cert_file: str, key_file: str, ca_file: str) -> ssl.SSLContext:
    """Client side: TLS 1.2+, presents our certificate, verifies the server against the grid CA.

    check_hostname is False: servers are authenticated by SAN URI identity, which the
    caller checks after the handshake with `peer_identity` + `require_identity`.
    The chain is still verified (CERT_REQUIRED), so the identity read is trustworthy.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    _load_own_certificate(ctx, cert_file, key_file)
    _load_ca(ctx, ca_file)
    return ctx


class TLSMaterial(msgspec.Struct, frozen=True):
    """Checked TLS material, ready to swap in. Times are unix seconds."""

    identity: PeerIdentity
    not_before: float
    not_after: float
    fingerprint_sha256: str
    server_context: ssl.SSLContext
    client_context: ssl.SSLContext
    cert_file: str
    key_file: str
    ca_file: str
    files_sha256: str
    """``tls_files_digest`` of the three files as checked: a reload whose digest differs rotated
    the material (a new certificate, key or CA bundle), and both roles restart their links."""


def tls_files_digest(cert_pem: bytes, key_pem: bytes, ca_pem: bytes) -> str:
    """Certificate, key and CA bundle together, in that order: SHA-256 over each file's own
    SHA-256, so no shift of bytes between two files can leave the digest unchanged. A change
    to any of them (a CA rotation too) is a new identity for this daemon's connections."""
    digest = hashlib.sha256()
    for data in (cert_pem, key_pem, ca_pem):
        digest.update(hashlib.sha256(data).digest())
    return digest.hexdigest()


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError as exc:
        raise TLSMaterialError(f"{path}: {what} file not found", reason="unreadable", path=path) from exc
    except OSError as exc:
        raise TLSMaterialError(
            f"{path}: cannot read {what} file: {exc.strerror}", reason="unreadable", path=path
        ) from exc


def _pem_certificates(data: bytes, path: str, what: str) -> list[x509.Certificate]:
    try:
        return x509.load_pem_x509_certificates(data)
    except ValueError as exc:
        raise TLSMaterialError(
            f"{path}: no valid PEM certificate in {what} file", reason="malformed", path=path
        ) from exc


def _pem_private_key(data: bytes, path: str) -> Any:
    try:
        return serialization.load_pem_private_key(data, password=None)
    except TypeError as exc:  # encrypted key and no password
        raise TLSMaterialError(
            f"{path}: private key is encrypted; gridd needs an unencrypted key", reason="malformed", path=path
        ) from exc
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise TLSMaterialError(
            f"{path}: not a readable PEM private key", reason="malformed", path=path
        ) from exc


def _spki(key: Any) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def _utc(ts: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC)


def _verify_chain(
    leaf: x509.Certificate,
    intermediates: list[x509.Certificate],
    cas: list[x509.Certificate],
    *,
    now: float,
    cert_file: str,
    ca_file: str,
) -> x509.Certificate:
    """Verify leaf -> CA with OpenSSL at time `now`; return the trust anchor that was used."""
    store = openssl_crypto.X509Store()
    for ca in cas:
        store.add_cert(openssl_crypto.X509.from_cryptography(ca))
    store.set_time(_utc(now))
    chain = [openssl_crypto.X509.from_cryptography(c) for c in intermediates]
    store_ctx = openssl_crypto.X509StoreContext(store, openssl_crypto.X509.from_cryptography(leaf), chain)
    try:
        verified = store_ctx.get_verified_chain()
    except openssl_crypto.X509StoreContextError as exc:
        code, _depth, message = exc.errors
        failing_der = exc.certificate.to_cryptography().public_bytes(serialization.Encoding.DER)
        in_ca = any(ca.public_bytes(serialization.Encoding.DER) == failing_der for ca in cas)
        path = ca_file if in_ca else cert_file
        reason = {
            _X509_V_ERR_CERT_HAS_EXPIRED: "expired",
            _X509_V_ERR_CERT_NOT_YET_VALID: "not_yet_valid",
        }.get(code, "untrusted")
        if reason == "untrusted":
            raise TLSMaterialError(
                f"{cert_file}: does not chain to the CA in {ca_file}: {message}",
                reason=reason,
                path=cert_file,
            ) from exc
        raise TLSMaterialError(f"{path}: {message} at the check time", reason=reason, path=path) from exc
    return verified[-1].to_cryptography()


def _check_usage(leaf: x509.Certificate, role: str, cert_file: str) -> None:
    # Every role is a TLS client on the signals channel; operators also serve it.
    # An absent EKU extension means "any purpose" to OpenSSL, so it passes here too.
    try:
        eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return
    wanted = {ExtendedKeyUsageOID.CLIENT_AUTH: "clientAuth"}
    if role == "operator":
        wanted[ExtendedKeyUsageOID.SERVER_AUTH] = "serverAuth"
    missing = [name for oid, name in wanted.items() if oid not in eku]
    if missing:
        raise TLSMaterialError(
            f"{cert_file}: extended key usage lacks {', '.join(missing)} needed by a {role}",
            reason="usage",
            path=cert_file,
        )


def check_tls_material(
    cert_file: str,
    key_file: str,
    ca_file: str,
    *,
    now: float,
    expected_site: str,
    expected_role: str,
    expected_trust_domain: str | None = None,
    expected_replica: str | None = None,
) -> TLSMaterial:
    """Check certificate, key and CA files as a staged reload must, and build both contexts.

    In order: all three files read and parse; the key matches the certificate; the
    certificate is valid at `now` (unix seconds); it chains to a CA in `ca_file` (which
    must also be valid at `now`); it names exactly one identity, of `expected_site` and
    `expected_role` (and the trust domain / replica when given; a CA that declares a
    trust domain by a bare spiffe:// URI SAN must match it); its key usage allows the
    role. Raises TLSMaterialError naming the file and the problem; returns only when the
    material can be swapped in.
    """
    cert_pem = _read(cert_file, "certificate")
    key_pem = _read(key_file, "private key")
    ca_pem = _read(ca_file, "CA")
    leaf, *intermediates = _pem_certificates(cert_pem, cert_file, "certificate")
    cas = _pem_certificates(ca_pem, ca_file, "CA")
    key = _pem_private_key(key_pem, key_file)

    if _spki(key.public_key()) != _spki(leaf.public_key()):
        raise TLSMaterialError(
            f"{key_file}: private key does not match certificate {cert_file}",
            reason="key_mismatch",
            path=key_file,
        )

    not_before = leaf.not_valid_before_utc.timestamp()
    not_after = leaf.not_valid_after_utc.timestamp()
    if now < not_before:
        raise TLSMaterialError(
            f"{cert_file}: not valid before {leaf.not_valid_before_utc.isoformat()}",
            reason="not_yet_valid",
            path=cert_file,
        )
    if now > not_after:  # notAfter is inclusive (RFC 5280 4.1.2.5)
        raise TLSMaterialError(
            f"{cert_file}: expired at {leaf.not_valid_after_utc.isoformat()}",
            reason="expired",
            path=cert_file,
        )

    anchor = _verify_chain(leaf, intermediates, cas, now=now, cert_file=cert_file, ca_file=ca_file)

    try:
        identity = identity_from_certificate(leaf)
    except IdentityError as exc:
        raise TLSMaterialError(f"{cert_file}: {exc}", reason="identity", path=cert_file) from exc
    anchor_domain = declared_trust_domain(anchor)
    mismatches = []
    if anchor_domain is not None and identity.trust_domain != anchor_domain:
        mismatches.append(f"trust domain {anchor_domain!r} of its CA")
    if expected_trust_domain is not None and identity.trust_domain != expected_trust_domain:
        mismatches.append(f"trust domain {expected_trust_domain!r}")
    if identity.site != expected_site:
        mismatches.append(f"site {expected_site!r}")
    if identity.role != expected_role:
        mismatches.append(f"role {expected_role!r}")
    if expected_replica is not None and identity.replica != expected_replica:
        mismatches.append(f"replica {expected_replica!r}")
    if mismatches:
        raise TLSMaterialError(
            f"{cert_file}: identity {identity.uri} does not match expected " + ", ".join(mismatches),
            reason="identity",
            path=cert_file,
        )

    _check_usage(leaf, identity.role, cert_file)

    server_ctx = server_context(cert_file, key_file, ca_file)
    client_ctx = client_context(cert_file, key_file, ca_file)

    # The contexts loaded the files again; if a rotation rewrote them meanwhile, what we
    # checked is not what we would serve. Refuse; the next reload sees settled files.
    for path, checked in ((cert_file, cert_pem), (key_file, key_pem), (ca_file, ca_pem)):
        if _read(path, "TLS") != checked:
            raise TLSMaterialError(
                f"{path}: changed while the reload was being checked; retry", reason="changed", path=path
            )

    return TLSMaterial(
        identity=identity,
        not_before=not_before,
        not_after=not_after,
        fingerprint_sha256=hashlib.sha256(leaf.public_bytes(serialization.Encoding.DER)).hexdigest(),
        server_context=server_ctx,
        client_context=client_ctx,
        cert_file=cert_file,
        key_file=key_file,
        ca_file=ca_file,
        files_sha256=tls_files_digest(cert_pem, key_pem, ca_pem),
    )
