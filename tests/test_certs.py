"""`gridd certs` tooling and the staged check of TLS material."""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
import ssl
import stat
import time
from pathlib import Path

import pytest
import trustme
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from gridd import certs
from gridd.tls import (
    PeerIdentity,
    TLSMaterial,
    TLSMaterialError,
    check_tls_material,
    declared_trust_domain,
    tls_files_digest,
)

TD = "grid.local"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = certs.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def grid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    """A directory with a CA, site a's operator and gateway g1, and site b's operator."""
    directory = tmp_path / "grid"
    assert run(capsys, "init", str(directory))[0] == 0
    assert run(capsys, "issue", "--site", "a", "--role", "operator", str(directory))[0] == 0
    assert run(capsys, "issue", "--site", "a", "--role", "gateway", "--replica", "g1", str(directory))[0] == 0
    assert run(capsys, "issue", "--site", "b", "--role", "operator", str(directory))[0] == 0
    return directory


def material(
    directory: Path,
    stem: str,
    *,
    ca: Path | None = None,
    now: float | None = None,
    site: str = "a",
    role: str = "operator",
    **kwargs: str,
) -> TLSMaterial:
    return check_tls_material(
        str(directory / f"{stem}.pem"),
        str(directory / f"{stem}-key.pem"),
        str(ca or directory / "ca.pem"),
        now=time.time() if now is None else now,
        expected_site=site,
        expected_role=role,
        **kwargs,
    )


def rejection(directory: Path, stem: str, **kwargs: object) -> TLSMaterialError:
    with pytest.raises(TLSMaterialError) as info:
        material(directory, stem, **kwargs)  # type: ignore[arg-type]
    return info.value


def load_cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


# --------------------------------------------------------------------------- init


def test_init_writes_ca_and_private_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    directory = tmp_path / "new" / "ca"
    code, out, err = run(capsys, "init", str(directory), "--trust-domain", "prod.example", "--days", "10")
    assert (code, err) == (0, "")
    assert out.splitlines() == [str(directory / "ca.pem"), str(directory / "ca-key.pem")]
    assert mode(directory / "ca-key.pem") == 0o600
    assert mode(directory) == 0o700
    ca = load_cert(directory / "ca.pem")
    assert declared_trust_domain(ca) == "prod.example"
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    assert isinstance(ca.public_key(), ec.EllipticCurvePublicKey)
    assert ca.public_key().curve.name == "secp256r1"
    lifetime = ca.not_valid_after_utc - ca.not_valid_before_utc
    assert lifetime == datetime.timedelta(days=10, seconds=certs.BACKDATE_SECONDS)


def test_init_refuses_to_overwrite_without_force(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "init", str(tmp_path))[0] == 0
    before = (tmp_path / "ca.pem").read_bytes()
    code, out, err = run(capsys, "init", str(tmp_path))
    assert (code, out) == (1, "")
    assert "ca.pem already exists" in err and "--force" in err and err.count("\n") == 1
    assert (tmp_path / "ca.pem").read_bytes() == before
    assert run(capsys, "init", "--force", str(tmp_path))[0] == 0
    assert (tmp_path / "ca.pem").read_bytes() != before
    assert mode(tmp_path / "ca-key.pem") == 0o600


def test_init_refuses_when_only_the_key_exists(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "ca-key.pem").write_bytes(b"precious")
    code, _, err = run(capsys, "init", str(tmp_path))
    assert code == 1 and "ca-key.pem already exists" in err
    assert (tmp_path / "ca-key.pem").read_bytes() == b"precious"


# --------------------------------------------------------------------------- issue


def test_issue_writes_named_files_accepted_by_the_check(
    grid: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "issue", "--site", "c", "--role", "gateway", "--replica", "gw-2", str(grid))
    assert (code, err) == (0, "")
    assert out.splitlines() == [str(grid / "c-gateway-gw-2.pem"), str(grid / "c-gateway-gw-2-key.pem")]
    assert mode(grid / "c-gateway-gw-2-key.pem") == 0o600

    operator = material(grid, "a-operator")
    assert operator.identity == PeerIdentity(TD, "a", "operator")
    gateway = material(
        grid, "c-gateway-gw-2", site="c", role="gateway", expected_trust_domain=TD, expected_replica="gw-2"
    )
    assert gateway.identity == PeerIdentity(TD, "c", "gateway", "gw-2")
    cert = load_cert(grid / "c-gateway-gw-2.pem")
    assert gateway.not_after == cert.not_valid_after_utc.timestamp()
    assert gateway.not_before == cert.not_valid_before_utc.timestamp()
    assert gateway.fingerprint_sha256 == cert.fingerprint(hashes.SHA256()).hex()
    for ctx in (gateway.server_context, gateway.client_context):
        assert isinstance(ctx, ssl.SSLContext) and ctx.verify_mode == ssl.CERT_REQUIRED


def test_issued_certificate_contents(grid: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, _ = run(
        capsys,
        "issue",
        "--site",
        "a",
        "--role",
        "gateway",
        "--replica",
        "g2",
        "--days",
        "7",
        "--dns",
        "gw.example.com",
        "--ip",
        "10.1.2.3",
        "--dns",
        "gw2.example.com",
        str(grid),
    )
    assert code == 0
    cert = load_cert(grid / "a-gateway-g2.pem")
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [f"spiffe://{TD}/site/a/gateway/g2"]
    assert san.get_values_for_type(x509.DNSName) == ["localhost", "gw.example.com", "gw2.example.com"]
    assert san.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address(a) for a in ("127.0.0.1", "::1", "10.1.2.3")
    ]
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    assert cert.public_key().curve.name == "secp256r1"
    assert cert.not_valid_after_utc - cert.not_valid_before_utc == datetime.timedelta(
        days=7, seconds=certs.BACKDATE_SECONDS
    )
    assert cert.issuer == load_cert(grid / "ca.pem").subject


def test_issue_no_loopback(grid: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        run(
            capsys,
            "issue",
            "--site",
            "a",
            "--role",
            "operator",
            "--no-loopback",
            "--dns",
            "op.a.example",
            str(grid),
        )[0]
        == 0
    )
    san = (
        load_cert(grid / "a-operator.pem")
        .extensions.get_extension_for_class(x509.SubjectAlternativeName)
        .value
    )
    assert san.get_values_for_type(x509.DNSName) == ["op.a.example"]
    assert san.get_values_for_type(x509.IPAddress) == []


def test_leaf_validity_is_cut_to_the_ca(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "init", "--days", "2", str(tmp_path))[0] == 0
    code, _, err = run(capsys, "issue", "--site", "a", "--role", "operator", "--days", "30", str(tmp_path))
    assert code == 0 and "validity cut" in err
    assert (
        load_cert(tmp_path / "a-operator.pem").not_valid_after_utc
        == load_cert(tmp_path / "ca.pem").not_valid_after_utc
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "required"),
        (["bogus"], "invalid choice"),
        (["init"], "required"),
        (["init", "DIR", "--trust-domain", "Grid.Local"], "invalid trust domain"),
        (["init", "DIR", "--days", "0"], "days must be between"),
        (["init", "DIR", "--days", "soon"], "whole number"),
        (["issue", "DIR", "--role", "operator"], "--site"),
        (["issue", "DIR", "--site", "a"], "--role"),
        (["issue", "DIR", "--site", "a", "--role", "admin"], "invalid choice"),
        (["issue", "DIR", "--site", "a", "--role", "gateway"], "needs --replica"),
        (["issue", "DIR", "--site", "a", "--role", "operator", "--replica", "r1"], "only to --role gateway"),
        (["issue", "DIR", "--site", "Site_A", "--role", "operator"], "invalid site name"),
        (["issue", "DIR", "--site", "a", "--role", "gateway", "--replica", "R1"], "invalid gateway replica"),
        (["issue", "DIR", "--site", "a", "--role", "operator", "--dns", "bad name"], "not a DNS name"),
        (["issue", "DIR", "--site", "a", "--role", "operator", "--ip", "300.1.1.1"], "not an IP address"),
    ],
)
def test_usage_errors_exit_2_with_one_line(
    grid: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    argv = [str(grid) if a == "DIR" else a for a in argv]
    before = sorted(p.name for p in grid.iterdir())
    code, out, err = run(capsys, *argv)
    assert (code, out) == (2, "")
    assert err.startswith("gridd certs: error: ") and err.count("\n") == 1
    assert message in err
    assert sorted(p.name for p in grid.iterdir()) == before


def test_issue_without_a_ca_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "issue", "--site", "a", "--role", "operator", str(tmp_path))
    assert (code, out) == (1, "")
    assert "gridd certs init" in err and err.count("\n") == 1


def test_issue_refuses_a_ca_without_trust_domain(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    ca.private_key_pem.write_to_path(str(tmp_path / "ca-key.pem"))
    code, _, err = run(capsys, "issue", "--site", "a", "--role", "operator", str(tmp_path))
    assert code == 1 and "trust domain" in err


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert certs.main(["--help"]) == 0
    assert "init" in capsys.readouterr().out


# --------------------------------------------------------------------------- staged check: rejections


@pytest.mark.parametrize(
    ("stem", "kwargs", "expect"),
    [
        ("a-operator", {"role": "gateway"}, "role 'gateway'"),
        ("a-operator", {"site": "b"}, "site 'b'"),
        ("b-operator", {}, "site 'a'"),
        ("a-gateway-g1", {}, "role 'operator'"),
        ("a-gateway-g1", {"role": "gateway", "expected_replica": "g2"}, "replica 'g2'"),
        ("a-operator", {"expected_trust_domain": "prod.example"}, "trust domain 'prod.example'"),
    ],
)
def test_wrong_identity_is_rejected(grid: Path, stem: str, kwargs: dict, expect: str) -> None:
    err = rejection(grid, stem, **kwargs)
    assert err.reason == "identity"
    assert err.path == str(grid / f"{stem}.pem")
    assert expect in str(err) and str(grid / f"{stem}.pem") in str(err)


def test_key_of_another_certificate_is_rejected(grid: Path) -> None:
    with pytest.raises(TLSMaterialError) as info:
        check_tls_material(
            str(grid / "a-operator.pem"),
            str(grid / "b-operator-key.pem"),
            str(grid / "ca.pem"),
            now=time.time(),
            expected_site="a",
            expected_role="operator",
        )
    assert info.value.reason == "key_mismatch"
    assert info.value.path == str(grid / "b-operator-key.pem")
    assert "does not match" in str(info.value)


def test_expired_certificate_is_rejected(grid: Path) -> None:
    not_after = load_cert(grid / "a-operator.pem").not_valid_after_utc.timestamp()
    assert material(grid, "a-operator", now=not_after).identity.site == "a"  # notAfter itself is still valid
    err = rejection(grid, "a-operator", now=not_after + 1)
    assert (err.reason, err.path) == ("expired", str(grid / "a-operator.pem"))
    assert "expired" in str(err)


def test_short_lived_certificate_expires(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "init", str(tmp_path))[0] == 0
    assert run(capsys, "issue", "--site", "a", "--role", "operator", "--days", "1", str(tmp_path))[0] == 0
    assert material(tmp_path, "a-operator", now=time.time() + 86400 - 60).identity.role == "operator"
    assert rejection(tmp_path, "a-operator", now=time.time() + 86400 + 60).reason == "expired"


def test_not_yet_valid_certificate_is_rejected(grid: Path) -> None:
    not_before = load_cert(grid / "a-operator.pem").not_valid_before_utc.timestamp()
    assert rejection(grid, "a-operator", now=not_before - 1).reason == "not_yet_valid"


def test_certificate_from_another_ca_is_rejected(
    grid: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "other"
    assert run(capsys, "init", str(other))[0] == 0
    assert run(capsys, "issue", "--site", "a", "--role", "operator", str(other))[0] == 0
    err = rejection(other, "a-operator", ca=grid / "ca.pem")
    assert (err.reason, err.path) == ("untrusted", str(other / "a-operator.pem"))
    assert "does not chain" in str(err) and str(grid / "ca.pem") in str(err)


def test_trustme_certificate_is_untrusted_by_grid_ca(grid: Path, tmp_path: Path) -> None:
    leaf = trustme.CA().issue_cert("localhost")
    leaf.cert_chain_pems[0].write_to_path(str(tmp_path / "t.pem"))
    leaf.private_key_pem.write_to_path(str(tmp_path / "t-key.pem"))
    assert rejection(tmp_path, "t", ca=grid / "ca.pem").reason == "untrusted"


def test_trustme_material_without_identity_is_rejected(tmp_path: Path) -> None:
    ca = trustme.CA()
    leaf = ca.issue_cert("localhost")
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    leaf.cert_chain_pems[0].write_to_path(str(tmp_path / "t.pem"))
    leaf.private_key_pem.write_to_path(str(tmp_path / "t-key.pem"))
    err = rejection(tmp_path, "t")
    assert err.reason == "identity" and "no spiffe" in str(err)


def _foreign_leaf(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    uri: str,
    *,
    not_after: datetime.datetime,
    eku: list[x509.ObjectIdentifier] | None = None,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A leaf built by hand, for the shapes `gridd certs issue` never produces."""
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "hand-made")]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(ca_cert.not_valid_before_utc)
        .not_valid_after(not_after)
        .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(uri)]), critical=False)
    )
    if eku is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage(eku), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def _write_leaf(directory: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
    (directory / f"{stem}.pem").write_bytes(certs.certificate_pem(cert))
    (directory / f"{stem}-key.pem").write_bytes(certs.private_key_pem(key))


def _grid_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = serialization.load_pem_private_key((directory / "ca-key.pem").read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    return load_cert(directory / "ca.pem"), key


def test_expired_ca_is_rejected_naming_the_ca_file(grid: Path) -> None:
    ca_cert, ca_key = _grid_ca(grid)
    leaf, key = _foreign_leaf(
        ca_cert,
        ca_key,
        f"spiffe://{TD}/site/a/operator",
        not_after=ca_cert.not_valid_after_utc + datetime.timedelta(days=30),
    )
    _write_leaf(grid, "outlives-ca", leaf, key)
    err = rejection(grid, "outlives-ca", now=ca_cert.not_valid_after_utc.timestamp() + 86400)
    assert (err.reason, err.path) == ("expired", str(grid / "ca.pem"))


def test_leaf_outside_the_ca_trust_domain_is_rejected(grid: Path) -> None:
    ca_cert, ca_key = _grid_ca(grid)
    cert, key = certs.issue_certificate(
        ca_cert, ca_key, PeerIdentity("evil.example", "a", "operator"), now=time.time(), days=1
    )
    _write_leaf(grid, "evil", cert, key)
    err = rejection(grid, "evil")
    assert err.reason == "identity" and f"trust domain '{TD}' of its CA" in str(err)


def test_key_usage_must_allow_the_role(grid: Path) -> None:
    ca_cert, ca_key = _grid_ca(grid)
    later = ca_cert.not_valid_after_utc
    cert, key = _foreign_leaf(
        ca_cert,
        ca_key,
        f"spiffe://{TD}/site/a/operator",
        not_after=later,
        eku=[ExtendedKeyUsageOID.CLIENT_AUTH],
    )
    _write_leaf(grid, "client-only-operator", cert, key)
    err = rejection(grid, "client-only-operator")
    assert err.reason == "usage" and "serverAuth" in str(err)
    # A gateway only ever dials out, so clientAuth alone is enough for it.
    cert, key = _foreign_leaf(
        ca_cert,
        ca_key,
        f"spiffe://{TD}/site/a/gateway/g9",
        not_after=later,
        eku=[ExtendedKeyUsageOID.CLIENT_AUTH],
    )
    _write_leaf(grid, "client-only-gateway", cert, key)
    assert material(grid, "client-only-gateway", role="gateway").identity.replica == "g9"
    cert, key = _foreign_leaf(
        ca_cert,
        ca_key,
        f"spiffe://{TD}/site/a/gateway/g8",
        not_after=later,
        eku=[ExtendedKeyUsageOID.SERVER_AUTH],
    )
    _write_leaf(grid, "server-only-gateway", cert, key)
    assert rejection(grid, "server-only-gateway", role="gateway").reason == "usage"


@pytest.mark.parametrize("which", ["cert", "key", "ca"])
def test_missing_files_are_unreadable(grid: Path, which: str) -> None:
    paths = {"cert": grid / "a-operator.pem", "key": grid / "a-operator-key.pem", "ca": grid / "ca.pem"}
    paths[which].unlink()
    err = rejection(grid, "a-operator")
    assert (err.reason, err.path) == ("unreadable", str(paths[which]))
    assert str(paths[which]) in str(err) and "not found" in str(err)


@pytest.mark.parametrize("which", ["cert", "key", "ca"])
def test_garbage_files_are_malformed(grid: Path, which: str) -> None:
    paths = {"cert": grid / "a-operator.pem", "key": grid / "a-operator-key.pem", "ca": grid / "ca.pem"}
    paths[which].write_bytes(b"-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    err = rejection(grid, "a-operator")
    assert (err.reason, err.path) == ("malformed", str(paths[which]))


def test_encrypted_key_is_rejected(grid: Path) -> None:
    key = serialization.load_pem_private_key((grid / "a-operator-key.pem").read_bytes(), password=None)
    (grid / "a-operator-key.pem").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    err = rejection(grid, "a-operator")
    assert err.reason == "malformed" and "encrypted" in str(err)


# --------------------------------------------------------------------------- staged check: rotation


def test_ca_bundle_with_old_and_new_ca_accepts_both(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    for directory in (old, new):
        assert run(capsys, "init", str(directory))[0] == 0
        assert run(capsys, "issue", "--site", "a", "--role", "operator", str(directory))[0] == 0
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes((old / "ca.pem").read_bytes() + (new / "ca.pem").read_bytes())
    assert material(old, "a-operator", ca=bundle).identity.site == "a"
    assert material(new, "a-operator", ca=bundle).identity.site == "a"
    assert rejection(old, "a-operator", ca=new / "ca.pem").reason == "untrusted"


def test_reissue_replaces_the_pair(grid: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = material(grid, "a-operator").fingerprint_sha256
    assert run(capsys, "issue", "--site", "a", "--role", "operator", str(grid))[0] == 0
    after = material(grid, "a-operator")
    assert after.fingerprint_sha256 != before
    assert mode(grid / "a-operator-key.pem") == 0o600
    assert not [p for p in grid.iterdir() if p.name.startswith(".")]


def test_files_digest_covers_exactly_the_checked_files(
    grid: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The one TLS file digest (both roles restart their links when it changes): SHA-256 over
    the certificate's, the key's and the CA bundle's own SHA-256, in that order."""
    first = material(grid, "a-operator")
    files = [grid / "a-operator.pem", grid / "a-operator-key.pem", grid / "ca.pem"]
    inner = b"".join(hashlib.sha256(f.read_bytes()).digest() for f in files)
    assert first.files_sha256 == hashlib.sha256(inner).hexdigest()
    assert first.files_sha256 == tls_files_digest(*(f.read_bytes() for f in files))
    assert material(grid, "a-operator").files_sha256 == first.files_sha256  # same files, same digest
    # a re-issued certificate (new key too) is a rotation
    assert run(capsys, "issue", "--site", "a", "--role", "operator", str(grid))[0] == 0
    assert material(grid, "a-operator").files_sha256 != first.files_sha256
    # bytes moved from one file to the next still change it
    assert tls_files_digest(b"ab", b"c", b"") != tls_files_digest(b"a", b"bc", b"")
