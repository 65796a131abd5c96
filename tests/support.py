"""Helpers shared by the in-process tests, one definition each: readings and batches for the
core, a grid CA writing certificate files, the whole grid on trio's MockClock with an
in-memory signals link, a scripted router for the gateway front, and the providers API over
a config file. (Helpers for tests that start real gridd processes: tests/realproc.py.)"""

from __future__ import annotations

import datetime
import math
import random
import ssl
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import trio
import trio.testing
import trustme
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from prometheus_client import CollectorRegistry

from gridd import certs, wire
from gridd.api.providers import ProvidersAPI
from gridd.config import load_config
from gridd.core.batch import Batch
from gridd.core.capacity import CapacityLearner
from gridd.core.decisions import Forward, UnknownModel
from gridd.core.knobs import RoutingKnobs
from gridd.core.ordering import CandidateView
from gridd.core.readings import LatencyBlock, LoadSignals, Revision, UnitLoad, sample_count
from gridd.core.store import GatewayStore
from gridd.gateway.service import GatewayService
from gridd.link.session import ChannelError
from gridd.operator.service import OperatorService
from gridd.sim.app import SimApp
from gridd.sim.model import knobs_from
from gridd.tls import PeerIdentity, client_context, server_context
from gridd.wire import LocalProvider, ServingConfig, SiteIngress

# --- readings, batches and the gateway store ---------------------------------------------------

WALL = 1_800_000_000.0  # the store tests' wall clock
SERVING = ServingConfig(
    providers=(LocalProvider("llama", "m", "http://a-llama/v1"),),
    ingresses=(SiteIngress("b", "http://b-gw"), SiteIngress("c", "http://c-gw")),
)


def load(*, ready=2, running=1.0, waiting=0.0, units=True, kv=0.2, flow=0.0) -> LoadSignals:
    """An EPP pool reading with ``ready`` per-endpoint series (none when ``units`` is False)."""
    unit_list = tuple(UnitLoad(f"u{i}", waiting=waiting) for i in range(ready)) if units else ()
    return LoadSignals(ready_endpoints=ready, units=unit_list, avg_running=running, avg_waiting=waiting,
                       kv_mean=kv, kv_spread=0.0, flow_queue=flow,
                       in_flight=(running + waiting) * ready + flow)


# Three sites' readings with known capacities and rho (4 units x the prior 8 = 32, and so on).
THREE_SITES = {"a": load(ready=4, running=1.0, kv=0.0),   # 4 units x prior 8 = 32; rho 4/32
               "b": load(ready=2, running=4.0, kv=0.0),   # 16; rho 8/16
               "c": load(ready=2, running=2.0, kv=0.0)}   # 16; rho 4/16


class BatchFeed:
    """Publishes per-(site, provider) batches with increasing sequences, like an operator."""

    def __init__(self) -> None:
        self.seq: dict[tuple[str, str], int] = {}

    def batch(self, site: str, provider: str = "llama", *, ready=True, ld: LoadSignals | None = None,
              epoch: int = int(WALL) - 100, age_s: float = 0.0) -> Batch:
        key = (site, provider)
        self.seq[key] = self.seq.get(key, 0) + 1
        ld = ld if ld is not None else load()
        rev = Revision(f"uid-{site}", 1, epoch, self.seq[key], sample_count(ld))
        return Batch(site=site, provider=provider, model="m", published_ms=int(WALL * 1000), age_s=age_s,
                     revision=rev, complete=True, ready=ready, ready_reason="", load=ld)


def store(**knobs) -> GatewayStore:
    """Gateway a's store with SERVING (its provider llama, ingresses b and c) and ``knobs``."""
    s = GatewayStore(site="a", knobs=RoutingKnobs(**knobs))
    s.set_serving(SERVING)
    return s


def batch(epoch: int | None, seq: int = 1, *, site: str = "b", provider: str = "m", model: str = "m",
          published_ms: int | None = None, age_s: float = 0.0, complete: bool = True,
          ready: bool | None = True, ready_reason: str = "", load: LoadSignals | None = None,
          samples: int | None = None, latency: LatencyBlock | None = None,
          probes: dict[str, float] | None = None) -> Batch:
    """One batch of ``site``'s operator: revision (provider uid "u1", generation 7, ``epoch``,
    ``seq``), or none when ``epoch`` is None; ``samples`` defaults to what ``load`` carries and
    ``published_ms`` to ``seq`` ms after the epoch."""
    if samples is None:
        samples = sample_count(load) if load is not None else 0
    return Batch(
        site=site,
        provider=provider,
        model=model,
        published_ms=(epoch or 0) * 1000 + seq if published_ms is None else published_ms,
        age_s=age_s,
        revision=None if epoch is None else Revision("u1", 7, epoch, seq, samples),
        complete=complete,
        ready=ready,
        ready_reason=ready_reason,
        load=load,
        latency=latency,
        probes={} if probes is None else probes,
    )


def rev(seq: int, *, uid: str = "u1", gen: int = 7, epoch: int = 1, samples: int = 3) -> Revision:
    return Revision(provider_uid=uid, generation=gen, publisher_epoch=epoch, batch_sequence=seq,
                    batch_samples=samples)


def epp(running: float, waiting: float = 0.0, *, ready: int = 2, flow: float = 0.0,
        kv: float | None = None, spread: float | None = None, queue_full: int = 0) -> LoadSignals:
    """An EPP pool reading without per-endpoint series: pool means x ready endpoints."""
    return LoadSignals(ready_endpoints=ready, avg_running=running, avg_waiting=waiting, flow_queue=flow,
                       kv_mean=kv, kv_spread=spread, queue_full_units=queue_full)


class LearnerFeed:
    """Drives one capacity learner with consecutive sequences of one revision identity."""

    def __init__(self, learner: CapacityLearner) -> None:
        self.learner = learner
        self.seq = 0

    def __call__(self, now: float, load: LoadSignals, *, uid: str = "u1", gen: int = 7, epoch: int = 1,
                 samples: int = 3, complete: bool = True) -> None:
        self.seq += 1
        self.learner.observe(now, rev(self.seq, uid=uid, gen=gen, epoch=epoch, samples=samples), load,
                             complete=complete, new_sample=True)


def view(site: str, capacity: float = 10.0, rho: float = 0.5, **kw: object) -> CandidateView:
    return CandidateView(site=site, provider="p", model="m", capacity=capacity, rho=rho, **kw)


# --- certificates ------------------------------------------------------------------------------

TD = "grid.local"
OPERATOR_A = PeerIdentity(TD, "a", "operator")
OPERATOR_B = PeerIdentity(TD, "b", "operator")
GATEWAY_A1 = PeerIdentity(TD, "a", "gateway", "g1")


class Issuer:
    """A CA (gridd's own or trustme's) writing ca.pem and leaf PEM files into a directory."""

    def __init__(self, directory: Path, ca_cert: x509.Certificate,
                 ca_key: ec.EllipticCurvePrivateKey) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.dir = directory
        self.ca_cert = ca_cert
        self.ca_key = ca_key
        self.ca_file = str(directory / "ca.pem")
        Path(self.ca_file).write_bytes(certs.certificate_pem(ca_cert))

    @classmethod
    def gridd(cls, directory: Path, trust_domain: str = TD, *, now: float | None = None,
              ca_since: float = 0.0) -> Issuer:
        """A gridd CA created ``ca_since`` seconds before ``now`` (default: the real clock)."""
        created = (time.time() if now is None else now) - ca_since
        return cls(directory, *certs.create_ca(trust_domain, now=created, days=30))

    @classmethod
    def trustme(cls, directory: Path) -> tuple[Issuer, trustme.CA]:
        ca = trustme.CA()
        ca_cert = x509.load_pem_x509_certificate(ca.cert_pem.bytes())
        ca_key = serialization.load_pem_private_key(ca.private_key_pem.bytes(), password=None)
        return cls(directory, ca_cert, ca_key), ca

    def _write(self, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> tuple[str, str]:
        cert_file, key_file = self.dir / f"{stem}.pem", self.dir / f"{stem}-key.pem"
        cert_file.write_bytes(certs.certificate_pem(cert))
        key_file.write_bytes(certs.private_key_pem(key))
        return str(cert_file), str(key_file)

    def issue(self, identity: PeerIdentity, *, now: float | None = None, days: int = 30,
              stem: str | None = None) -> tuple[str, str]:
        """(certificate file, key file) for ``identity``, named ``stem`` (default:
        site-role-replica, "x" for no replica)."""
        cert, key = certs.issue_certificate(
            self.ca_cert, self.ca_key, identity, now=time.time() if now is None else now, days=days
        )
        return self._write(stem or f"{identity.site}-{identity.role}-{identity.replica or 'x'}", cert, key)

    def leaf_with_sans(self, sans: list[x509.GeneralName], *,
                       common_name: str = "t") -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        """A leaf this CA signed with the given subject alternative names (none a gridd
        certificate would carry, unless the test asks)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self.ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .sign(self.ca_key, hashes.SHA256())
        )
        return cert, key

    def issue_without_identity(self) -> tuple[str, str]:
        """A leaf the CA signed that names no spiffe identity (DNS name only)."""
        return self._write("anonymous",
                           *self.leaf_with_sans([x509.DNSName("localhost")], common_name="anonymous"))

    def server(self, identity: PeerIdentity = OPERATOR_A) -> ssl.SSLContext:
        return server_context(*self.issue(identity), self.ca_file)

    def client(self, identity: PeerIdentity = GATEWAY_A1) -> ssl.SSLContext:
        return client_context(*self.issue(identity), self.ca_file)


# The certificate files of the grid below (and of the peer tests): both sites' operators,
# gateway a's replica g1, and a second certificate of operator a's for a rotation.
GRID_CERTIFICATES = {"a-operator": OPERATOR_A, "a-operator-2": OPERATOR_A, "b-operator": OPERATOR_B,
                     "a-gateway-g1": GATEWAY_A1}


def write_certs(directory: Path, now: float | None = None) -> None:
    """A fresh grid CA and GRID_CERTIFICATES in ``directory``, valid from ``now`` (default:
    the real clock) for 30 days."""
    issuer = Issuer.gridd(directory, now=now)
    for stem, identity in GRID_CERTIFICATES.items():
        issuer.issue(identity, now=now, stem=stem)


# --- the whole grid on MockClock ---------------------------------------------------------------


def just_before(t: float) -> float:
    """The last instant MockClock can stand at before ``t``: "not yet" asserted exactly."""
    return math.nextafter(t, -math.inf)


async def settle_at(t: float) -> None:
    """Stand at ``t`` once every task due by then has run (on memory links and in-process
    apps an exchange takes no virtual time)."""
    await trio.sleep_until(t)
    await trio.testing.wait_all_tasks_blocked()


WALL0 = 1_800_000_000.0  # the grid's wall clock at trio time 0


def wall() -> float:
    return WALL0 + trio.current_time()


def operator_config(site: str, other: str) -> str:
    return f"""
role: operator
site: {site}
tls: {{ca: certs/ca.pem, cert: certs/{site}-operator.pem, key: certs/{site}-operator-key.pem}}
state_dir: state-{site}
ingress: http://gw-{site}
providers:
  - name: pool-{site}
    model: m
    settings: {{endpoint: "http://sim-{site}/v1"}}
    metrics: {{url: "http://sim-{site}/metrics", timeout_s: 2}}
peers:
  - {{site: {other}, url: "wss://op-{other}:1/signals", ingress: "http://gw-{other}"}}
"""


GATEWAY = """
role: gateway
site: a
replica: g1
tls: {ca: certs/ca.pem, cert: certs/a-gateway-g1.pem, key: certs/a-gateway-g1-key.pem}
operator: {url: "wss://op-a:1/signals"}
availability: {shedding: {enabled: true, full_after_ms: 2000, room_after_ms: 5000}}
"""


class MemorySession:
    """The server side of an in-memory signals connection (what RelayEndpoint reads)."""

    def __init__(self, identity: PeerIdentity, inbox, outbox, where: str) -> None:
        self.identity, self._in, self._out, self.where = identity, inbox, outbox, where

    async def receive(self) -> wire.Message:
        try:
            return wire.decode(await self._in.receive())
        except trio.EndOfChannel:
            raise ChannelError("closed", reason="connect") from None

    async def send(self, msg: wire.Message) -> None:
        await self.send_frame(wire.encode(msg))

    async def send_frame(self, frame: bytes) -> None:
        try:
            await self._out.send(frame)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise ChannelError("closed", reason="connect") from None


class MemoryLink:
    def __init__(self, outbox, inbox, up: dict, server: PeerIdentity, exchanges: list | None = None) -> None:
        self._out, self._in, self._up = outbox, inbox, up
        self.exchanges = exchanges  # (time, request, replies) of every exchange, when given
        self.identity = server  # the verified identity of the operator answering
        self.connections_opened = 1

    async def exchange(self, msg: wire.Message) -> list[wire.Message]:
        if not self._up["up"]:
            await trio.sleep_forever()  # an unreachable operator: the caller's budget ends it
        await self._out.send(wire.encode(msg))
        replies = []
        while True:
            reply = wire.decode(await self._in.receive())
            replies.append(reply)
            if isinstance(reply, wire.Batches | wire.FeedbackAck | wire.Error):
                if self.exchanges is not None:
                    self.exchanges.append((trio.current_time(), msg, replies))
                return replies


def memory_link_factory(endpoint, identity: PeerIdentity, up: dict, server: PeerIdentity,
                        exchanges: list | None = None):
    @asynccontextmanager
    async def open_link(*_args):
        c2s_send, c2s_recv = trio.open_memory_channel(math.inf)
        s2c_send, s2c_recv = trio.open_memory_channel(math.inf)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(endpoint.handle, MemorySession(identity, c2s_recv, s2c_send, identity.uri))
            yield MemoryLink(c2s_send, s2c_recv, up, server, exchanges)
            nursery.cancel_scope.cancel()

    return open_link


class Grid:
    """Operators a and b and gateway a's replica g1 as their real trio tasks, simulators as
    in-process ASGI apps, and the signals channel an in-memory link that still runs every
    frame through the wire codec and the operator's real endpoint.

    walls: a site's operator wall clock, when not ``wall``; operator_yaml: text appended to a
    site's operator config; state_io: the operators' state IO; wrap_operator_link: wraps the
    gateway's link to operator a (a fault injector); reporter_epoch: the gateway's."""

    def __init__(self, tmp_path: Path, *, walls: dict[str, Callable[[], float]] | None = None,
                 operator_yaml: dict[str, str] | None = None, state_io=None,
                 wrap_operator_link: Callable[[MemoryLink], object] | None = None,
                 reporter_epoch: int | None = None) -> None:
        write_certs(tmp_path / "certs", WALL0)
        self.sims = {site: SimApp(knobs_from({"endpoints": 2, "model": "m"})) for site in ("a", "b")}
        self.up = {"a": {"up": True}, "b": {"up": True}}
        self.operators: dict[str, OperatorService] = {}
        extra = {} if state_io is None else {"state_io": state_io}
        for site, other in (("a", "b"), ("b", "a")):
            text = operator_config(site, other) + (operator_yaml or {}).get(site, "")
            (tmp_path / f"op-{site}.yaml").write_text(text)
            client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.sims[site]))
            self.operators[site] = OperatorService(
                load_config(tmp_path / f"op-{site}.yaml", env={}), CollectorRegistry(),
                wall=(walls or {}).get(site, wall), client=client, rng=random.Random(1),
                open_peer_link=self._peer_link(site, other), **extra)
        (tmp_path / "gw-a.yaml").write_text(GATEWAY)
        self.gateway_exchanges: list = []
        # When the gateway opened a link to operator a (a new poller opens a new one).
        self.operator_links_opened: list[float] = []
        inner = memory_link_factory(self.operators["a"].endpoint, GATEWAY_A1, self.up["a"], OPERATOR_A,
                                    self.gateway_exchanges)

        @asynccontextmanager
        async def open_operator_link(*args):
            self.operator_links_opened.append(trio.current_time())
            async with inner(*args) as link:
                yield link if wrap_operator_link is None else wrap_operator_link(link)

        self.gateway = GatewayService(
            load_config(tmp_path / "gw-a.yaml", env={}), CollectorRegistry(), wall=wall, rng=random.Random(2),
            open_operator_link=open_operator_link, reporter_epoch=reporter_epoch)

    def _peer_link(self, site: str, other: str):
        def open_link(peer):
            return memory_link_factory(self.operators[other].endpoint, PeerIdentity(TD, site, "operator"),
                                       self.up[other], PeerIdentity(TD, other, "operator"))()
        return open_link

    def ordered_sites(self) -> list[str]:
        snap = self.gateway.store.snapshots.get("m")
        return [] if snap is None else [v.site for v in snap.ordered]

    def excluded_sites(self) -> list[str]:
        snap = self.gateway.store.snapshots.get("m")
        return [] if snap is None else [v.site for v in snap.excluded]

    async def start(self, nursery, clock) -> float:
        # Start-up runs blocking work in threads (TLS checks, the durable epoch write); an
        # autojumping clock would leap to the next timer meanwhile. Hold time still while
        # starting, place the gateway half a second after the operators, then let it run.
        clock.autojump_threshold = math.inf
        origin = trio.current_time()
        await nursery.start(self.operators["a"].run)  # scrape passes at +0, +1, ...
        await nursery.start(self.operators["b"].run)  # a polls b at +0, +5, ...
        clock.jump(0.5)
        await nursery.start(self.gateway.run)  # gateway polls at +0.5, +1.5, ...
        clock.autojump_threshold = 0
        return origin

    @asynccontextmanager
    async def running(self, clock):
        """The grid started (``self.origin``: trio time at its start), stopped on the way out."""
        async with trio.open_nursery() as nursery:
            self.origin = await self.start(nursery, clock)
            yield self
            nursery.cancel_scope.cancel()


# --- the gateway front -------------------------------------------------------------------------

FRONT_MODEL = "sim-model"


class FakeRouter:
    """The Router protocol with decisions the test controls; records every call."""

    def __init__(self, site: str, rule: Callable[[str, str | None, frozenset], object],
                 models: tuple[str, ...] = (FRONT_MODEL,)) -> None:
        self.site = site
        self.rule = rule
        self.calls: list[tuple[str, str | None, frozenset]] = []
        self._models = list(models)
        self.is_ready = True

    def decide(self, model, *, pinned_site=None, exclude=frozenset()):
        self.calls.append((model, pinned_site, exclude))
        return self.rule(model, pinned_site, exclude)

    def models(self):
        return list(self._models)

    def ready(self):
        return self.is_ready

    def not_ready_reason(self):
        return None if self.is_ready else "no routing data from the operator: no poll has succeeded yet"

    async def first_routing_data(self):
        await self.had_data.wait()

    @property
    def had_data(self) -> trio.Event:
        if not hasattr(self, "_had_data"):
            self._had_data = trio.Event()
            if self.is_ready:
                self._had_data.set()
        return self._had_data


def always(decision):
    """A FakeRouter rule: ``decision`` for FRONT_MODEL, any other model unknown."""
    return lambda model, pinned, exclude: decision if model == FRONT_MODEL else UnknownModel()


def local(site: str, provider: str, url: str, **provider_fields) -> Forward:
    return Forward(site, provider, FRONT_MODEL,
                   local=LocalProvider(provider, FRONT_MODEL, url + "/v1", **provider_fields))


# --- the providers API -------------------------------------------------------------------------

WRITE_TOKEN = "file-token-0123456789"
PROVIDERS_ENV = {"LLAMA_KEY": "llama-secret", "SECRET_KEY": "from-env", "ADMIN_TOKEN": "s3cret-admin"}

PROVIDERS_CONFIG = """\
# The operator of site a. (This comment is lost on the first API write: docs/providers-api.md.)
role: operator
site: a
state_dir: state
listen:
  http: 127.0.0.1:0
{api}providers:
  - name: local
    type: hosted_vllm
    model: Qwen/Qwen3.5-9B
    enabled: true
    metadata: {{labels: [local], cost: 0}}
    settings:
      endpoint: http://localhost:8088/v1
      timeout: 300.0
      auth: {{scheme: none, api_key: null, custom_headers: {{}}}}
  - name: keyed
    model: meta-llama/Llama-3.1-8B-Instruct
    settings:
      endpoint: http://127.0.0.1:8089/v1
      auth: {{scheme: bearer, api_key: "${{LLAMA_KEY}}"}}
  - name: secret
    model: m
    settings:
      endpoint: http://127.0.0.1:8090/v1
      auth:
        scheme: bearer
        api_key: sk-literal
        custom_headers: {{x-api-key: hdr-secret, x-team: blue}}
    metrics: {{url: "http://scraper:pw@127.0.0.1:8090/metrics"}}
"""


class ProvidersRig:
    """The providers API over a tmp config file (PROVIDERS_CONFIG); ``reload`` stands in for
    the daemon's staged reload: it reloads the file (or rejects with ``reject``) and records
    each call."""

    def __init__(self, tmp_path, *, api: str = "", max_body_bytes: int | None = None) -> None:
        self.path = tmp_path / "operator.yaml"
        self.path.write_text(PROVIDERS_CONFIG.format(api=api))
        self.loaded = load_config(self.path, env=PROVIDERS_ENV)
        self.reloads = 0
        self.reject: str | None = None
        self.reload_delay_s = 0.0
        kwargs = {} if max_body_bytes is None else {"max_body_bytes": max_body_bytes}
        self.app = ProvidersAPI(loaded=lambda: self.loaded, reload=self.reload, env=PROVIDERS_ENV,
                                write_token=lambda: WRITE_TOKEN, **kwargs)
        # Writes always need a token (docs/security.md): the rig's client sends the token
        # file's unless a test says otherwise.
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app),
                                        base_url="http://127.0.0.1",
                                        headers={"authorization": f"Bearer {WRITE_TOKEN}"})
        self.anonymous = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app),
                                           base_url="http://127.0.0.1")

    async def reload(self):
        self.reloads += 1
        await trio.sleep(self.reload_delay_s)
        if self.reject:
            return {"result": "error", "error": self.reject}
        self.loaded = await trio.to_thread.run_sync(lambda: load_config(self.path, env=PROVIDERS_ENV))
        return {"result": "ok", "error": None}

    def on_disk(self) -> dict:
        return yaml.safe_load(self.path.read_text())
