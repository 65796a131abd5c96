"""`gridd certs`: make a grid CA and issue operator/gateway certificates.

    gridd certs init DIR [--trust-domain grid.local] [--days 3650] [--force]
    gridd certs issue --site S --role operator|gateway [--replica R] [--days 365]
                      [--dns NAME ...] [--ip ADDR ...] [--no-loopback] DIR

`main(argv)` takes the arguments after `certs`. Exit status: 0 done, 1 could not do it
(existing CA without --force, unreadable CA, I/O error), 2 usage error. Errors are one
line on stderr; the paths written are printed on stdout, one per line.

Keys are ECDSA P-256. The CA certificate declares its trust domain by a bare
`spiffe://<trust-domain>` URI SAN; `issue` reads it from there. Leaf certificates carry
the identity URI (see gridd.tls), the loopback names (DNS localhost, IP 127.0.0.1 and
::1, unless --no-loopback) plus any --dns/--ip, and EKU serverAuth + clientAuth.
`create_ca` and `issue_certificate` are the same operations as library calls with an
explicit `now`, for tests and tooling.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gridd.tls import IdentityError, PeerIdentity, declared_trust_domain, is_valid_trust_domain

CA_CERT_NAME = "ca.pem"
CA_KEY_NAME = "ca-key.pem"
DEFAULT_TRUST_DOMAIN = "grid.local"
DEFAULT_CA_DAYS = 3650
DEFAULT_LEAF_DAYS = 365
MAX_DAYS = 36500
# Certificates start this far in the past so a peer whose clock runs a little behind
# does not see a brand-new certificate as not yet valid.
BACKDATE_SECONDS = 300
LOOPBACK_DNS = ("localhost",)
LOOPBACK_IPS = ("127.0.0.1", "::1")

_DNS_NAME = re.compile(
    r"(?:\*\.)?(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)*"
    r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
)


def _utc(ts: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC)


def _key_usage(*, ca: bool) -> x509.KeyUsage:
    """ECDSA signing only; a CA also signs certificates and CRLs."""
    return x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                         data_encipherment=False, key_agreement=False, key_cert_sign=ca, crl_sign=ca,
                         encipher_only=False, decipher_only=False)


def create_ca(
    trust_domain: str, *, now: float, days: int
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A self-signed grid CA for `trust_domain`, valid from `now` - BACKDATE_SECONDS for `days`."""
    if not is_valid_trust_domain(trust_domain):
        raise IdentityError(f"invalid trust domain {trust_domain!r}")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "gridd"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"gridd CA {trust_domain}"[:64]),
        ]
    )
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_utc(now - BACKDATE_SECONDS))
        .not_valid_after(_utc(now + days * 86400))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(ca=True), critical=True)
        .add_extension(ski, critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
        .add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(f"spiffe://{trust_domain}")]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    return cert, key


def issue_certificate(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    identity: PeerIdentity,
    *,
    now: float,
    days: int,
    dns_names: Sequence[str] = LOOPBACK_DNS,
    ip_addresses: Sequence[str] = LOOPBACK_IPS,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A leaf certificate naming `identity`, signed by the CA.

    Validity starts BACKDATE_SECONDS before `now` and lasts `days`, clipped to the CA's
    own validity (a certificate cannot usefully outlive its issuer).
    """
    key = ec.generate_private_key(ec.SECP256R1())
    not_before = max(_utc(now - BACKDATE_SECONDS), ca_cert.not_valid_before_utc)
    not_after = min(_utc(now + days * 86400), ca_cert.not_valid_after_utc)
    if not_after <= not_before:
        raise ValueError(f"the CA is not valid between {not_before.isoformat()} and {not_after.isoformat()}")
    common_name = identity.role if identity.replica is None else f"{identity.role} {identity.replica}"
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "gridd"),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, identity.site),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64]),
        ]
    )
    sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(identity.uri)]
    sans += [x509.DNSName(name) for name in dict.fromkeys(dns_names)]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in dict.fromkeys(ip_addresses)]
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(ca=False), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def certificate_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def private_key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def leaf_file_names(identity: PeerIdentity) -> tuple[str, str]:
    """(certificate, key) file names: <site>-<role>[-<replica>].pem and ...-key.pem."""
    stem = f"{identity.site}-{identity.role}"
    if identity.replica is not None:
        stem += f"-{identity.replica}"
    return f"{stem}.pem", f"{stem}-key.pem"


class _UsageError(Exception):
    pass


class _Failure(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(message)


def _days(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number of days: {text!r}") from None
    if not 1 <= value <= MAX_DAYS:
        raise argparse.ArgumentTypeError(f"days must be between 1 and {MAX_DAYS}, got {value}")
    return value


def _build_parser() -> _Parser:
    parser = _Parser(
        prog="gridd certs", description="Make a grid CA and issue operator/gateway certificates."
    )
    sub = parser.add_subparsers(dest="command", metavar="{init,issue}", parser_class=_Parser)
    sub.required = True

    init = sub.add_parser("init", help="create DIR/ca.pem and DIR/ca-key.pem")
    init.add_argument("dir", metavar="DIR")
    init.add_argument("--trust-domain", default=DEFAULT_TRUST_DOMAIN)
    init.add_argument("--days", type=_days, default=DEFAULT_CA_DAYS)
    init.add_argument("--force", action="store_true", help="replace an existing CA")

    issue = sub.add_parser("issue", help="issue DIR/<site>-<role>[-<replica>].pem and -key.pem from DIR's CA")
    issue.add_argument("dir", metavar="DIR")
    issue.add_argument("--site", required=True)
    issue.add_argument("--role", required=True, choices=["operator", "gateway"])
    issue.add_argument("--replica")
    issue.add_argument("--days", type=_days, default=DEFAULT_LEAF_DAYS)
    issue.add_argument(
        "--dns", action="append", default=[], metavar="NAME", help="extra DNS SAN (repeatable)"
    )
    issue.add_argument("--ip", action="append", default=[], metavar="ADDR", help="extra IP SAN (repeatable)")
    issue.add_argument(
        "--no-loopback", action="store_true", help="omit the default localhost / 127.0.0.1 / ::1 SANs"
    )
    return parser


def _write_atomically(path: Path, data: bytes, mode: int) -> None:
    # Write a sibling temp file with the final mode from the start (a key is never
    # readable by others, not even briefly), then rename over the target.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)  # the umask may have narrowed os.open's mode
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _init(args: argparse.Namespace, now: float) -> list[Path]:
    if not is_valid_trust_domain(args.trust_domain):
        raise _UsageError(
            f"invalid trust domain {args.trust_domain!r} (lowercase letters, digits, '.', '-', '_')"
        )
    directory = Path(args.dir)
    cert_path, key_path = directory / CA_CERT_NAME, directory / CA_KEY_NAME
    existing = [p for p in (cert_path, key_path) if p.exists()]
    if existing and not args.force:
        raise _Failure(
            f"{existing[0]} already exists; pass --force to replace the grid CA "
            "(every certificate it issued stops being trusted)"
        )
    cert, key = create_ca(args.trust_domain, now=now, days=args.days)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    _write_atomically(key_path, private_key_pem(key), 0o600)
    _write_atomically(cert_path, certificate_pem(cert), 0o644)
    return [cert_path, key_path]


def _load_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey, str]:
    cert_path, key_path = directory / CA_CERT_NAME, directory / CA_KEY_NAME
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    except OSError as exc:
        raise _Failure(
            f"cannot read the grid CA certificate {cert_path}: {exc.strerror} (run 'gridd certs init' first)"
        ) from exc
    except ValueError as exc:
        raise _Failure(f"{cert_path}: not a PEM certificate") from exc
    try:
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except OSError as exc:
        raise _Failure(f"cannot read the grid CA key {key_path}: {exc.strerror}") from exc
    except (ValueError, TypeError) as exc:
        raise _Failure(f"{key_path}: not an unencrypted PEM private key") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise _Failure(f"{key_path}: not an ECDSA key")
    cert_key = cert.public_key()
    if (not isinstance(cert_key, ec.EllipticCurvePublicKey)
            or key.public_key().public_numbers() != cert_key.public_numbers()):
        raise _Failure(f"{key_path} does not match {cert_path}")
    trust_domain = declared_trust_domain(cert)
    if trust_domain is None:
        raise _Failure(f"{cert_path} declares no spiffe:// trust domain; was it made by 'gridd certs init'?")
    return cert, key, trust_domain


def _issue(args: argparse.Namespace, now: float) -> list[Path]:
    if args.role == "gateway" and not args.replica:
        raise _UsageError("--role gateway needs --replica NAME")
    if args.role == "operator" and args.replica is not None:
        raise _UsageError("--replica applies only to --role gateway")
    for name in args.dns:
        if _DNS_NAME.fullmatch(name) is None or len(name) > 253:
            raise _UsageError(f"--dns {name!r} is not a DNS name")
    for ip in args.ip:
        try:
            ipaddress.ip_address(ip)
        except ValueError:
            raise _UsageError(f"--ip {ip!r} is not an IP address") from None
    directory = Path(args.dir)
    ca_cert, ca_key, trust_domain = _load_ca(directory)
    try:
        identity = PeerIdentity(trust_domain, args.site, args.role, args.replica)
    except IdentityError as exc:
        raise _UsageError(
            f"{exc} (names are 1-63 of [a-z0-9.-], starting and ending with a letter or digit)"
        ) from None
    if ca_cert.not_valid_after_utc.timestamp() <= now:
        raise _Failure(f"the grid CA {directory / CA_CERT_NAME} has expired")
    dns_names = [*(() if args.no_loopback else LOOPBACK_DNS), *args.dns]
    ip_addresses = [*(() if args.no_loopback else LOOPBACK_IPS), *args.ip]
    try:
        cert, key = issue_certificate(
            ca_cert, ca_key, identity, now=now, days=args.days, dns_names=dns_names, ip_addresses=ip_addresses
        )
    except ValueError as exc:
        raise _Failure(f"{directory / CA_CERT_NAME}: {exc}") from exc
    if now + args.days * 86400 > ca_cert.not_valid_after_utc.timestamp():
        print(
            f"gridd certs: note: validity cut to the CA's expiry, {cert.not_valid_after_utc.isoformat()}",
            file=sys.stderr,
        )
    cert_name, key_name = leaf_file_names(identity)
    # Key first, then certificate: a reload that lands between the two renames sees a
    # key/cert mismatch and is rejected, and the next reload picks up the pair.
    _write_atomically(directory / key_name, private_key_pem(key), 0o600)
    _write_atomically(directory / cert_name, certificate_pem(cert), 0o644)
    return [directory / cert_name, directory / key_name]


def main(argv: list[str]) -> int:
    """Run `gridd certs` with the arguments after `certs`; returns the exit status."""
    try:
        args = _build_parser().parse_args(argv)
    except _UsageError as exc:
        print(f"gridd certs: error: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    now = time.time()
    try:
        written = _init(args, now) if args.command == "init" else _issue(args, now)
    except _UsageError as exc:
        print(f"gridd certs: error: {exc}", file=sys.stderr)
        return 2
    except _Failure as exc:
        print(f"gridd certs: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"gridd certs: {exc.filename or args.dir}: {exc.strerror}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0
