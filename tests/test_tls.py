"""Peer identity parsing and real mutual-TLS handshakes (memory streams and loopback TCP)."""

from __future__ import annotations

import ssl
import time
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio
import trio.testing
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from hypothesis import given
from hypothesis import strategies as st
from support import GATEWAY_A1, OPERATOR_A, TD, Issuer

from gridd import certs
from gridd.tls import (
    IdentityError,
    PeerAuthError,
    PeerIdentity,
    TLSError,
    TLSMaterialError,
    check_tls_material,
    client_context,
    identity_from_certificate,
    is_valid_name,
    parse_identity_uri,
    peer_auth_error,
    peer_identity,
    require_identity,
    server_context,
)

# --------------------------------------------------------------------------- helpers


class HandshakeResult:
    def __init__(self) -> None:
        self.server_saw: PeerIdentity | None = None
        self.client_saw: PeerIdentity | None = None
        self.server_error: trio.BrokenResourceError | None = None
        self.client_error: trio.BrokenResourceError | None = None
        self.client_received = b""


async def handshake(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext) -> HandshakeResult:
    """Run both ends of a TLS handshake over an in-memory stream pair.

    The server, once the handshake succeeds, records the client's verified identity and
    sends b"hello"; the client records the server's identity after reading it. A side
    whose handshake fails records the error and closes its transport so the other end
    sees EOF instead of waiting forever.
    """
    server_raw, client_raw = trio.testing.memory_stream_pair()
    server = trio.SSLStream(server_raw, server_ctx, server_side=True)
    client = trio.SSLStream(client_raw, client_ctx, server_hostname=None)
    result = HandshakeResult()

    async def serve() -> None:
        try:
            await server.do_handshake()
            result.server_saw = peer_identity(server)
            await server.send_all(b"hello")
        except trio.BrokenResourceError as exc:
            result.server_error = exc
            await server.transport_stream.aclose()

    async def connect() -> None:
        try:
            await client.do_handshake()
            result.client_received = await client.receive_some()
            result.client_saw = peer_identity(client)
        except trio.BrokenResourceError as exc:
            result.client_error = exc
            await client.transport_stream.aclose()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            nursery.start_soon(connect)
    return result


def reason_of(exc: BaseException | None) -> str | None:
    assert exc is not None
    err = peer_auth_error(exc)
    assert isinstance(err, PeerAuthError)
    return err.reason


# --------------------------------------------------------------------------- identity URIs

VALID_URIS = [
    ("spiffe://grid.local/site/a/operator", PeerIdentity("grid.local", "a", "operator")),
    ("spiffe://grid.local/site/a/gateway/g1", PeerIdentity("grid.local", "a", "gateway", "g1")),
    ("spiffe://example.org/site/eu-west-1/operator", PeerIdentity("example.org", "eu-west-1", "operator")),
    ("spiffe://td/site/0/gateway/gw-7d9f8b-xk2lp", PeerIdentity("td", "0", "gateway", "gw-7d9f8b-xk2lp")),
    (
        "spiffe://my_trust-domain.io/site/b/gateway/host1.dc2.example",
        PeerIdentity("my_trust-domain.io", "b", "gateway", "host1.dc2.example"),
    ),
    ("spiffe://grid.local/site/" + "s" * 63 + "/operator", PeerIdentity("grid.local", "s" * 63, "operator")),
]

INVALID_URIS = [
    "",
    "spiffe://",
    "spiffe:///site/a/operator",  # empty trust domain
    "SPIFFE://grid.local/site/a/operator",  # scheme is lower case
    "https://grid.local/site/a/operator",
    "spiffe:/grid.local/site/a/operator",
    "spiffe://grid.local",
    "spiffe://grid.local/",
    "spiffe://grid.local/site/a",
    "spiffe://grid.local/site/a/",
    "spiffe://grid.local/site//operator",
    "spiffe://grid.local/site/a/operator/",
    "spiffe://grid.local/site/a/operator/x",  # operator has no replica
    "spiffe://grid.local/site/a/gateway",  # gateway needs one
    "spiffe://grid.local/site/a/gateway/",
    "spiffe://grid.local/site/a/gateway/g1/x",
    "spiffe://grid.local/site/a/admin",
    "spiffe://grid.local/sites/a/operator",
    "spiffe://grid.local/a/operator",
    "spiffe://Grid.local/site/a/operator",
    "spiffe://grid.local/site/A/operator",
    "spiffe://grid.local/site/a/Operator",
    "spiffe://grid.local/site/a/gateway/G1",
    "spiffe://grid.local:443/site/a/operator",
    "spiffe://user@grid.local/site/a/operator",
    "spiffe://grid.local/site/a/operator?x=1",
    "spiffe://grid.local/site/a/operator#frag",
    "spiffe://grid.local/site/%61/operator",
    "spiffe://grid.local/site/-a/operator",
    "spiffe://grid.local/site/a-/operator",
    "spiffe://grid.local/site/./operator",
    "spiffe://grid.local/site/../operator",
    "spiffe://grid.local/site/a b/operator",
    "spiffe://grid.local/site/\u00e4/operator",
    "spiffe://-grid.local/site/a/operator",
    "spiffe://grid.local/site/" + "s" * 64 + "/operator",
    "spiffe://grid.local/site/a/gateway/" + "r" * 64,
    " spiffe://grid.local/site/a/operator",
]

TRAILING_JUNK = ["/", " ", "\n", "\x00", "?", "#", "/x", "%20", ":1"]


@pytest.mark.parametrize(("uri", "expected"), VALID_URIS)
def test_parse_valid_identity_uris(uri: str, expected: PeerIdentity) -> None:
    identity = parse_identity_uri(uri)
    assert identity == expected
    assert identity.uri == uri


@pytest.mark.parametrize("uri", INVALID_URIS)
def test_parse_rejects_invalid_identity_uris(uri: str) -> None:
    with pytest.raises(IdentityError) as info:
        parse_identity_uri(uri)
    assert info.value.reason == "identity"


@pytest.mark.parametrize("junk", TRAILING_JUNK)
@pytest.mark.parametrize("uri", [u for u, _ in VALID_URIS])
def test_parse_rejects_trailing_junk(uri: str, junk: str) -> None:
    with pytest.raises(IdentityError):
        parse_identity_uri(uri + junk)


@pytest.mark.parametrize("uri", [u for u, _ in VALID_URIS])
def test_parse_every_prefix_is_rejected_or_itself_well_formed(uri: str) -> None:
    # A cut URI must never parse to something other than exactly what it says.
    accepted = []
    for cut in range(len(uri)):
        prefix = uri[:cut]
        try:
            identity = parse_identity_uri(prefix)
        except IdentityError:
            continue
        assert identity.uri == prefix
        accepted.append(prefix)
    # Only truncations inside the final name can still be valid URIs.
    last_name_start = uri.rindex("/") + 1
    assert all(len(p) > last_name_start for p in accepted)


def test_parse_rejects_non_strings() -> None:
    with pytest.raises(IdentityError):
        parse_identity_uri(b"spiffe://grid.local/site/a/operator")  # type: ignore[arg-type]


_names = st.from_regex(r"[a-z0-9](?:[a-z0-9.-]{0,61}[a-z0-9])?", fullmatch=True)
_domains = st.from_regex(r"[a-z0-9](?:[a-z0-9._-]{0,40}[a-z0-9])?", fullmatch=True)


@given(trust_domain=_domains, site=_names, replica=st.none() | _names)
def test_identity_uri_round_trips(trust_domain: str, site: str, replica: str | None) -> None:
    role = "operator" if replica is None else "gateway"
    identity = PeerIdentity(trust_domain, site, role, replica)
    assert parse_identity_uri(identity.uri) == identity


@pytest.mark.parametrize(
    "args",
    [
        (TD, "a", "operator", "g1"),
        (TD, "a", "gateway", None),
        (TD, "a", "gateway", ""),
        (TD, "a", "admin", None),
        (TD, "", "operator", None),
        ("Grid", "a", "operator", None),
        (TD, "a_b", "operator", None),
    ],
)
def test_peer_identity_validates_on_construction(args: tuple) -> None:
    with pytest.raises(IdentityError):
        PeerIdentity(*args)


@pytest.mark.parametrize(
    ("name", "valid"),
    [
        ("a", True),
        ("a.b-c", True),
        ("0", True),
        ("a" * 63, True),
        ("a" * 64, False),
        ("", False),
        ("-a", False),
        ("a.", False),
        ("A", False),
        ("a_b", False),
        ("a/b", False),
    ],
)
def test_name_rule(name: str, valid: bool) -> None:
    assert is_valid_name(name) is valid


# --------------------------------------------------------------------------- certificates -> identity


@pytest.mark.parametrize(
    ("san", "expected"),
    [
        ((("URI", OPERATOR_A.uri),), OPERATOR_A),
        ((("DNS", "localhost"), ("URI", GATEWAY_A1.uri), ("IP Address", "127.0.0.1")), GATEWAY_A1),
        ((("URI", "https://example.org/x"), ("URI", OPERATOR_A.uri)), OPERATOR_A),
    ],
)
def test_identity_from_peercert_dict(san: tuple, expected: PeerIdentity) -> None:
    assert identity_from_certificate({"subject": (), "subjectAltName": san}) == expected


@pytest.mark.parametrize(
    "peercert",
    [
        None,
        {},
        b"",
        {"subjectAltName": (("DNS", "localhost"),)},
        {"subjectAltName": (("URI", "https://example.org/"),)},
        {"subjectAltName": (("URI", OPERATOR_A.uri), ("URI", GATEWAY_A1.uri))},
        {"subjectAltName": (("URI", OPERATOR_A.uri), ("URI", OPERATOR_A.uri))},
        {"subjectAltName": (("URI", "SPIFFE://grid.local/site/a/operator"),)},
        {"subjectAltName": (("URI", "spiffe://grid.local/site/a/other"),)},
        b"\x30\x03\x02\x01\x00",
    ],
)
def test_identity_from_certificate_rejects(peercert: object) -> None:
    with pytest.raises(IdentityError):
        identity_from_certificate(peercert)  # type: ignore[arg-type]


def test_identity_from_der_certificate(tmp_path: Path) -> None:
    issuer = Issuer.gridd(tmp_path)
    cert_file, _ = issuer.issue(GATEWAY_A1)
    der = x509.load_pem_x509_certificate(Path(cert_file).read_bytes()).public_bytes(
        serialization.Encoding.DER
    )
    assert identity_from_certificate(der) == GATEWAY_A1


def test_der_certificate_with_two_spiffe_uris_is_rejected(tmp_path: Path) -> None:
    issuer = Issuer.gridd(tmp_path)
    cert, _ = issuer.leaf_with_sans(
        [x509.UniformResourceIdentifier(OPERATOR_A.uri), x509.UniformResourceIdentifier(GATEWAY_A1.uri)],
    )
    with pytest.raises(IdentityError, match="2 spiffe"):
        identity_from_certificate(cert.public_bytes(serialization.Encoding.DER))
    only_dns, _ = issuer.leaf_with_sans([x509.DNSName("localhost")])
    with pytest.raises(IdentityError, match="no spiffe"):
        identity_from_certificate(only_dns)


@pytest.mark.parametrize(
    ("kwargs", "ok"),
    [
        ({"trust_domain": TD}, True),
        ({"trust_domain": TD, "site": "a", "role": "operator"}, True),
        ({"trust_domain": "other.td"}, False),
        ({"trust_domain": TD, "site": "b"}, False),
        ({"trust_domain": TD, "role": "gateway"}, False),
    ],
)
def test_require_identity(kwargs: dict, ok: bool) -> None:
    if ok:
        assert require_identity(OPERATOR_A, **kwargs) is OPERATOR_A
    else:
        with pytest.raises(IdentityError):
            require_identity(OPERATOR_A, **kwargs)


# --------------------------------------------------------------------------- error mapping


def _ssl_error(reason: str) -> ssl.SSLError:
    exc = ssl.SSLError(1, f"[SSL: {reason}] test")
    exc.reason = reason
    return exc


def _verify_error(code: int) -> ssl.SSLCertVerificationError:
    exc = ssl.SSLCertVerificationError(1, "certificate verify failed")
    exc.verify_code = code
    exc.verify_message = "test"
    return exc


@pytest.mark.parametrize(
    ("cause", "reason"),
    [
        (_verify_error(20), "untrusted"),
        (_verify_error(10), "expired"),
        (_verify_error(9), "not_yet_valid"),
        (_ssl_error("PEER_DID_NOT_RETURN_A_CERTIFICATE"), "no_certificate"),
        (_ssl_error("TLSV13_ALERT_CERTIFICATE_REQUIRED"), "rejected"),
        (_ssl_error("TLSV1_ALERT_UNKNOWN_CA"), "rejected"),
        (_ssl_error("SSLV3_ALERT_CERTIFICATE_EXPIRED"), "rejected"),
        (_ssl_error("WRONG_VERSION_NUMBER"), "handshake"),
        (ssl.SSLEOFError(8, "EOF occurred in violation of protocol"), "handshake"),
    ],
)
def test_peer_auth_error_reasons(cause: ssl.SSLError, reason: str) -> None:
    try:
        raise trio.BrokenResourceError from cause
    except trio.BrokenResourceError as exc:
        err = peer_auth_error(exc)
    assert isinstance(err, PeerAuthError) and isinstance(err, TLSError)
    assert err.reason == reason


def test_peer_auth_error_ignores_non_tls_failures() -> None:
    try:
        raise trio.BrokenResourceError from ConnectionResetError()
    except trio.BrokenResourceError as exc:
        assert peer_auth_error(exc) is None


# --------------------------------------------------------------------------- contexts


def test_context_settings(tmp_path: Path) -> None:
    issuer = Issuer.gridd(tmp_path)
    server = issuer.server()
    client = issuer.client()
    for ctx in (server, client):
        assert ctx.verify_mode == ssl.CERT_REQUIRED
        assert ctx.minimum_version == ssl.TLSVersion.TLSv1_2
        # The grid CA and nothing else is trusted.
        assert [int(c["serialNumber"], 16) for c in ctx.get_ca_certs()] == [issuer.ca_cert.serial_number]
    assert client.check_hostname is False


def test_context_errors_name_the_problem(tmp_path: Path) -> None:
    issuer = Issuer.gridd(tmp_path)
    cert_file, key_file = issuer.issue(OPERATOR_A)
    _, other_key = issuer.issue(GATEWAY_A1)
    with pytest.raises(TLSMaterialError) as info:
        server_context(str(tmp_path / "missing.pem"), key_file, issuer.ca_file)
    assert info.value.reason == "unreadable"
    with pytest.raises(TLSMaterialError) as info:
        client_context(cert_file, other_key, issuer.ca_file)
    assert (info.value.reason, info.value.path) == ("key_mismatch", other_key)
    junk = tmp_path / "junk.pem"
    junk.write_bytes(b"not a pem")
    with pytest.raises(TLSMaterialError) as info:
        client_context(cert_file, key_file, str(junk))
    assert (info.value.reason, info.value.path) == ("malformed", str(junk))


# --------------------------------------------------------------------------- handshakes


async def test_mutual_tls_with_gridd_certs(tmp_path: Path) -> None:
    issuer = Issuer.gridd(tmp_path)
    result = await handshake(issuer.server(OPERATOR_A), issuer.client(GATEWAY_A1))
    assert result.server_error is None and result.client_error is None
    assert result.server_saw == GATEWAY_A1
    assert result.client_saw == OPERATOR_A
    assert result.client_received == b"hello"


@pytest.mark.parametrize("tls_version", [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3])
async def test_mutual_tls_with_trustme_ca(tmp_path: Path, tls_version: ssl.TLSVersion) -> None:
    issuer, _ = Issuer.trustme(tmp_path)
    peer_b = PeerIdentity(TD, "b", "operator")
    client = issuer.client(peer_b)
    client.minimum_version = client.maximum_version = tls_version
    result = await handshake(issuer.server(OPERATOR_A), client)
    assert result.server_saw == peer_b
    assert result.client_saw == OPERATOR_A


async def test_trustme_leaf_without_identity_is_authenticated_but_unnamed(tmp_path: Path) -> None:
    issuer, ca = Issuer.trustme(tmp_path)
    leaf = ca.issue_cert("localhost", "127.0.0.1")
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False
    ca.configure_trust(client)
    leaf.configure_cert(client)
    server_raw, client_raw = trio.testing.memory_stream_pair()
    server = trio.SSLStream(server_raw, issuer.server(), server_side=True)
    client_stream = trio.SSLStream(client_raw, client, server_hostname=None)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client_stream.do_handshake)
            await server.do_handshake()
    # The chain verified, but a certificate without a spiffe URI names no peer.
    assert server.getpeercert()["subjectAltName"] == (("DNS", "localhost"), ("IP Address", "127.0.0.1"))
    with pytest.raises(IdentityError, match="no spiffe"):
        peer_identity(server)


async def test_client_without_certificate_is_refused(tmp_path: Path) -> None:
    issuer = Issuer.gridd(tmp_path)
    no_cert = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    no_cert.check_hostname = False
    no_cert.load_verify_locations(issuer.ca_file)
    result = await handshake(issuer.server(), no_cert)
    assert result.server_saw is None and result.client_received == b""
    assert reason_of(result.server_error) == "no_certificate"
    assert result.client_error is not None


async def test_client_certificate_from_another_ca_is_refused(tmp_path: Path) -> None:
    grid = Issuer.gridd(tmp_path / "grid")
    other = Issuer.gridd(tmp_path / "other")
    cert_file, key_file = other.issue(GATEWAY_A1)
    client = client_context(cert_file, key_file, grid.ca_file)  # trusts the server, but holds a foreign cert
    result = await handshake(grid.server(), client)
    assert result.server_saw is None
    assert reason_of(result.server_error) == "untrusted"
    assert result.client_error is not None


async def test_trustme_client_certificate_is_refused_by_gridd_ca(tmp_path: Path) -> None:
    grid = Issuer.gridd(tmp_path / "grid")
    foreign, _ = Issuer.trustme(tmp_path / "foreign")
    cert_file, key_file = foreign.issue(GATEWAY_A1)
    result = await handshake(grid.server(), client_context(cert_file, key_file, grid.ca_file))
    assert reason_of(result.server_error) == "untrusted"


async def test_server_certificate_from_another_ca_is_refused(tmp_path: Path) -> None:
    grid = Issuer.gridd(tmp_path / "grid")
    other = Issuer.gridd(tmp_path / "other")
    result = await handshake(other.server(), grid.client())
    assert result.client_saw is None
    assert reason_of(result.client_error) == "untrusted"
    assert result.server_error is not None


async def test_expired_client_certificate_is_refused(tmp_path: Path) -> None:
    issuer = Issuer.gridd(tmp_path, ca_since=10 * 86400)
    cert_file, key_file = issuer.issue(GATEWAY_A1, now=time.time() - 3 * 86400, days=1)
    result = await handshake(issuer.server(), client_context(cert_file, key_file, issuer.ca_file))
    assert reason_of(result.server_error) == "expired"


async def test_loopback_tcp_mutual_tls_with_checked_material(tmp_path: Path) -> None:
    assert certs.main(["init", str(tmp_path)]) == 0
    assert certs.main(["issue", "--site", "a", "--role", "operator", str(tmp_path)]) == 0
    assert certs.main(["issue", "--site", "a", "--role", "gateway", "--replica", "g1", str(tmp_path)]) == 0
    ca_file = str(tmp_path / "ca.pem")
    now = time.time()
    operator = check_tls_material(
        str(tmp_path / "a-operator.pem"),
        str(tmp_path / "a-operator-key.pem"),
        ca_file,
        now=now,
        expected_site="a",
        expected_role="operator",
    )
    gateway = check_tls_material(
        str(tmp_path / "a-gateway-g1.pem"),
        str(tmp_path / "a-gateway-g1-key.pem"),
        ca_file,
        now=now,
        expected_site="a",
        expected_role="gateway",
    )
    seen: list[PeerIdentity] = []

    async def handle(stream: trio.SSLStream) -> None:
        await stream.do_handshake()
        seen.append(peer_identity(stream))
        await stream.send_all(peer_identity(stream).uri.encode())
        await stream.aclose()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(
                partial(trio.serve_ssl_over_tcp, handle, 0, operator.server_context, host="127.0.0.1")
            )
            port = listeners[0].transport_listener.socket.getsockname()[1]
            stream = await trio.open_ssl_over_tcp_stream(
                "127.0.0.1", port, ssl_context=gateway.client_context
            )
            await stream.do_handshake()
            server_identity = require_identity(
                peer_identity(stream), trust_domain=TD, site="a", role="operator"
            )
            echoed = await stream.receive_some()
            await stream.aclose()
            nursery.cancel_scope.cancel()
    assert server_identity == OPERATOR_A
    assert seen == [GATEWAY_A1]
    assert echoed == GATEWAY_A1.uri.encode()


async def test_httpx_client_uses_client_context_and_reads_server_identity(tmp_path: Path) -> None:
    issuer = Issuer.gridd(tmp_path)
    server_ctx, client_ctx = issuer.server(OPERATOR_A), issuer.client(GATEWAY_A1)

    async def handle(stream: trio.SSLStream) -> None:
        # A one-shot HTTP/1.1 responder that answers with the client's verified identity.
        request = b""
        while b"\r\n\r\n" not in request:
            request += await stream.receive_some()
        body = peer_identity(stream).uri.encode()
        await stream.send_all(
            b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
        )
        await stream.aclose()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(
                partial(trio.serve_ssl_over_tcp, handle, 0, server_ctx, host="127.0.0.1")
            )
            port = listeners[0].transport_listener.socket.getsockname()[1]
            async with httpx.AsyncClient(verify=client_ctx) as client:
                async with client.stream("GET", f"https://127.0.0.1:{port}/") as response:
                    ssl_object = response.extensions["network_stream"].get_extra_info("ssl_object")
                    server_identity = peer_identity(ssl_object)
                    await response.aread()
            nursery.cancel_scope.cancel()
    assert response.text == GATEWAY_A1.uri
    assert server_identity == OPERATOR_A
