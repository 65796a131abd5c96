"""The operator's providers API (spec 004 Example 2; DESIGN 5, 5b): the ASGI app driven in
process over httpx.ASGITransport with a tmp config file and an injected reload, the pure
redaction/merge/auth rules table-driven, and one real operator process serving it on
loopback, posting the spec's Example 2 probe at a `gridd sim --flavour vllm`."""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import stat
import subprocess
import sys

import httpx
import pytest
import trio
import yaml
from prometheus_client import CollectorRegistry
from realproc import gridctl_status, start_gridd, wait_until
from support import PROVIDERS_CONFIG as CONFIG
from support import PROVIDERS_ENV as ENV
from support import WRITE_TOKEN, ProvidersRig

from gridd.api.access import bearer_matches, check_api_exposure
from gridd.api.config_edits import delete_provider, upsert_provider
from gridd.api.redaction import MASK, find_mask, redact_provider
from gridd.api.secret_origins import secret_bindings
from gridd.childprocs import free_ports, stop_processes
from gridd.config import load_config, parse_config
from gridd.errors import ConfigError, StateError
from gridd.operator.service import OperatorService

JSON = {"content-type": "application/json"}

EXAMPLE_2 = {
    "settings": {
        "endpoint": "http://localhost:8088/v1",
        "timeout": 300.0,
        "auth": {"scheme": "none", "api_key": None, "custom_headers": {}},
        "probes": [
            {
                "name": "perf",
                "enabled": True,
                "endpoint": "http://localhost:8088/metrics",
                "interval": 5,
                "extract": [{"regex": "vllm:(num_requests_waiting)\\{[^}]*\\}\\s+([0-9.eE+-]+)"}],
                "publish": [
                    {"to": "metadata", "prefix": "performance"},
                    {"to": "file", "path": "probes/local.perf.jsonl"},
                ],
            }
        ],
    }
}


def error_of(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


# ---------------------------------------------------------------------------------------------
# Pure rules


@pytest.mark.parametrize(("api_key", "shown"), [
    (None, None),
    ("", ""),
    ("${LLAMA_KEY}", "${LLAMA_KEY}"),
    ("${LLAMA_KEY:-}", "${LLAMA_KEY:-}"),
    ("Bearer ${TOKEN}", "Bearer ${TOKEN}"),
    ("${A}${B}", "${A}${B}"),
    ("${LLAMA_KEY:-sk-default}", MASK),  # the default may be the secret itself
    ("sk-literal", MASK),
    ("Bearer sk-literal", MASK),
    ("prefix-${A}", MASK),
])
def test_api_key_redaction(api_key, shown):
    provider = {"name": "p", "settings": {"auth": {"api_key": api_key}}}
    assert redact_provider(provider)["settings"]["auth"]["api_key"] == shown
    assert provider["settings"]["auth"]["api_key"] == api_key  # the input is not modified


@pytest.mark.parametrize(("header", "masked"), [
    ("authorization", True), ("Authorization", True), ("x-api-key", True), ("api-key", True),
    ("cookie", True), ("X-Auth-Token", True), ("x-client-secret", True), ("proxy-authorization", True),
    ("x-team", False), ("user-agent", False), ("x-request-id", False),
])
def test_custom_header_redaction(header, masked):
    provider = {"name": "p", "settings": {"auth": {"custom_headers": {header: "v-1", "x-other": "${X}"}}}}
    headers = redact_provider(provider)["settings"]["auth"]["custom_headers"]
    assert headers[header] == (MASK if masked else "v-1")
    assert headers["x-other"] == "${X}"


@pytest.mark.parametrize(("url", "shown"), [
    ("http://u:pw@h:1/metrics", f"http://u:{MASK}@h:1/metrics"),
    ("http://u:${PW}@h/metrics", "http://u:${PW}@h/metrics"),
    ("http://sk-live-123@h/metrics", f"http://{MASK}@h/metrics"),  # a token as the user name
    ("http://${TOKEN}@h/metrics", "http://${TOKEN}@h/metrics"),
    ("http://scraper:p@ssw0rd@h/metrics", f"http://scraper:{MASK}@h/metrics"),  # userinfo ends at the last @
    ("http://h/metrics?next=a:b@c", "http://h/metrics?next=a:b@c"),
    ("http://h/metrics?api_key=sk-9&x=1", f"http://h/metrics?api_key={MASK}&x=1"),
    ("http://h/metrics?api_key=${K}&x=1", "http://h/metrics?api_key=${K}&x=1"),
])
def test_url_password_redaction(url, shown):
    provider = {"name": "p", "metrics": {"url": url},
                "settings": {"endpoint": url, "probes": [{"endpoint": url}]}}
    out = redact_provider(provider)
    assert (out["metrics"]["url"], out["settings"]["endpoint"], out["settings"]["probes"][0]["endpoint"]) == (
        shown, shown, shown)


@pytest.mark.parametrize(("body", "path"), [
    ({"settings": {"auth": {"api_key": MASK}}}, "settings.auth.api_key"),
    ({"settings": {"endpoint": f"http://u:{MASK}@h/v1"}}, "settings.endpoint"),
    ({"settings": {"probes": [{"name": "a"}, {"endpoint": MASK}]}}, "settings.probes[1].endpoint"),
    ({"settings": {"auth": {"api_key": "sk-real"}}}, None),
    ({"model": "m", "enabled": True, "metadata": {"cost": 1}}, None),
])
def test_find_mask(body, path):
    assert find_mask(body) == path


def test_upsert_merges_top_level_fields_and_replaces_settings_whole():
    raw = {"role": "operator", "providers": [
        {"name": "a", "model": "m", "settings": {"endpoint": "http://x/v1", "timeout": 9,
                                                  "probes": [{"name": "old"}]}, "enabled": False}]}
    before = copy.deepcopy(raw)
    fields = {"settings": {"endpoint": "http://y/v1"}, "unavailable": True}
    tree, written, created = upsert_provider(raw, "a", fields)
    assert not created and raw == before
    assert written == {"name": "a", "model": "m", "settings": {"endpoint": "http://y/v1"}, "enabled": False,
                       "unavailable": True}
    assert list(written) == ["name", "model", "settings", "enabled", "unavailable"]
    assert tree["providers"] == [written]

    tree, written, created = upsert_provider({"role": "operator"}, "b", {"model": "m", "name": "b"})
    assert created and tree["providers"] == [{"name": "b", "model": "m"}] and list(written)[0] == "name"


def test_delete_provider_keeps_the_others():
    raw = {"providers": [{"name": "a"}, {"name": "b"}]}
    assert delete_provider(raw, "a") == {"providers": [{"name": "b"}]}
    assert raw == {"providers": [{"name": "a"}, {"name": "b"}]}


@pytest.mark.parametrize(("headers", "ok"), [
    ([b"Bearer tok"], True),
    ([b"bearer tok"], True),
    ([b"Bearer  tok "], True),
    ([b"Bearer tok2"], False),
    ([b"Bearer to"], False),
    ([b"Basic tok"], False),
    ([b"tok"], False),
    ([b"Bearer"], False),
    ([], False),
    ([b"Bearer tok", b"Bearer tok"], False),
])
def test_bearer_matches(headers, ok):
    assert bearer_matches(headers, "tok") is ok


@pytest.mark.parametrize(("listen", "token", "refused"), [
    (None, None, False),
    ("127.0.0.1:9180", None, False),
    ("127.5.5.5:9180", None, False),
    ("[::1]:9180", None, False),
    ("0.0.0.0:9180", None, True),
    ("[::]:9180", None, True),
    ("10.1.2.3:9180", None, True),
    ("localhost:9180", None, True),  # a name could resolve anywhere: only IP literals count
    ("0.0.0.0:9180", "", True),  # an empty token (an unset ${VAR:-}) is no token
    ("0.0.0.0:9180", "tok", False),
])
def test_api_exposure(listen, token, refused):
    api = "" if token is None else f"api: {{admin_token: {json.dumps(token)}}}\n"
    http = "" if listen is None else f"listen: {{http: {json.dumps(listen)}}}\n"
    cfg, _ = parse_config(f"role: operator\nsite: a\n{http}{api}", env={})
    if refused:
        with pytest.raises(ConfigError, match=r"^api\.admin_token: required when the providers API listens"):
            check_api_exposure(cfg)
    else:
        check_api_exposure(cfg)


# ---------------------------------------------------------------------------------------------
# The app, in process


async def test_get_lists_and_redacts(tmp_path):
    rig = ProvidersRig(tmp_path)
    listed = (await rig.client.get("/v1/providers")).json()
    assert listed["object"] == "list"
    assert [p["name"] for p in listed["data"]] == ["local", "keyed", "secret"]
    keyed, secret = listed["data"][1], listed["data"][2]
    assert keyed["settings"]["auth"]["api_key"] == "${LLAMA_KEY}"  # a placeholder, as written
    assert secret["settings"]["auth"] == {"scheme": "bearer", "api_key": MASK,
                                          "custom_headers": {"x-api-key": MASK, "x-team": "blue"}}
    assert secret["metrics"]["url"] == f"http://scraper:{MASK}@127.0.0.1:8090/metrics"
    one = await rig.client.get("/v1/providers/local")
    assert one.status_code == 200 and one.headers["content-type"] == "application/json"
    assert one.json() == rig.loaded.raw["providers"][0]
    missing = await rig.client.get("/v1/providers/nope")
    assert missing.status_code == 404
    assert error_of(missing) == {"message": "no provider named 'nope'", "type": "invalid_request_error",
                                 "param": "name", "code": "provider_not_found"}


async def test_example_2_settings_only_keeps_other_fields(tmp_path):
    rig = ProvidersRig(tmp_path)
    resp = await rig.client.post("/v1/providers/local", json=EXAMPLE_2)
    assert resp.status_code == 200, resp.text
    assert rig.reloads == 1
    got = resp.json()
    assert got["settings"] == EXAMPLE_2["settings"]
    # DESIGN 5b: the other top-level fields are kept, in their order.
    assert list(got) == ["name", "type", "model", "enabled", "metadata", "settings"]
    assert (got["model"], got["metadata"]) == ("Qwen/Qwen3.5-9B", {"labels": ["local"], "cost": 0})
    disk = rig.on_disk()
    assert disk["providers"][0]["settings"]["probes"][0]["name"] == "perf"
    assert disk["providers"][1]["settings"]["auth"]["api_key"] == "${LLAMA_KEY}"
    assert "${LLAMA_KEY}" in rig.path.read_text() and "llama-secret" not in rig.path.read_text()
    assert rig.loaded.config.providers[0].settings.probes[0].interval == 5
    assert (await rig.client.get("/v1/providers/local")).json()["settings"]["probes"] == (
        EXAMPLE_2["settings"]["probes"])

    # settings replaced whole: a POST without probes removes them.
    settings = {"endpoint": "http://localhost:8088/v1"}
    resp = await rig.client.post("/v1/providers/local", json={"settings": settings})
    assert resp.status_code == 200 and resp.json()["settings"] == settings
    assert rig.loaded.config.providers[0].settings.probes == []
    assert rig.loaded.config.providers[0].model == "Qwen/Qwen3.5-9B"


async def test_edit_in_place_round_trips_a_get(tmp_path):
    """Spec 004 "edit in place": a GET (no secret) spliced and POSTed back."""
    rig = ProvidersRig(tmp_path)
    current = (await rig.client.get("/v1/providers/local")).json()
    probe = EXAMPLE_2["settings"]["probes"][0]
    payload = {"settings": {**current["settings"], "probes": [
        *[p for p in current["settings"].get("probes", []) if p["name"] != probe["name"]], probe]}}
    assert (await rig.client.post("/v1/providers/local", json=payload)).status_code == 200
    again = (await rig.client.get("/v1/providers/local")).json()
    assert (await rig.client.post("/v1/providers/local", json=again)).status_code == 200
    assert rig.on_disk()["providers"][0] == again


async def test_create_and_delete(tmp_path):
    rig = ProvidersRig(tmp_path)
    body = {"model": "new-model", "settings": {"endpoint": "http://127.0.0.1:9000/v1"}}
    resp = await rig.client.post("/v1/providers/fresh", json=body)
    assert resp.status_code == 201, resp.text
    assert resp.headers["location"] == "/v1/providers/fresh"
    assert resp.json() == {"name": "fresh", **body}
    assert [p.name for p in rig.loaded.config.providers] == ["local", "keyed", "secret", "fresh"]
    assert rig.on_disk()["providers"][3] == {"name": "fresh", **body}

    resp = await rig.client.delete("/v1/providers/fresh")
    assert resp.status_code == 204 and resp.content == b""
    assert (await rig.client.get("/v1/providers/fresh")).status_code == 404
    assert [p["name"] for p in rig.on_disk()["providers"]] == ["local", "keyed", "secret"]
    before, reloads = rig.path.read_bytes(), rig.reloads
    gone = await rig.client.delete("/v1/providers/fresh")
    assert gone.status_code == 404 and error_of(gone)["code"] == "provider_not_found"
    assert rig.path.read_bytes() == before and rig.reloads == reloads


@pytest.mark.parametrize(("name", "body", "status", "code", "message", "param"), [
    ("local", {"settings": {**EXAMPLE_2["settings"], "probes": [{**EXAMPLE_2["settings"]["probes"][0],
                                                                  "interval": -1}]}},
     400, "invalid_config", "providers[0].settings.probes[0].interval: expected a number >= 0.1, got -1",
     "providers[0].settings.probes[0].interval"),
    ("fresh", {"settings": {"endpoint": "http://127.0.0.1:9000/v1"}},
     400, "invalid_config", "providers[3].model: required field is missing", "providers[3].model"),
    ("local", {"modle": "typo"},
     400, "invalid_config", "providers[0].modle: unknown field (check spelling; see docs/config.md)",
     "providers[0].modle"),
    ("Bad_Name", {"model": "m", "settings": {"endpoint": "http://127.0.0.1:9000/v1"}},
     400, "invalid_config", "providers[3].name: expected a string matching", "providers[3].name"),
    # a placeholder the running config does not use could send any environment variable
    # to an endpoint of the caller's choice
    ("local", {"settings": {"endpoint": "http://127.0.0.1:9/v1", "auth": {"api_key": "${NOT_SET}"}}},
     400, "unknown_placeholder", "placeholders the running config does not use: ${NOT_SET}", None),
    ("local", {"settings": {"endpoint": "http://127.0.0.1:9/v1", "custom_headers": {}, "auth": {
        "scheme": "header", "header_name": "x-leak", "api_key": "${HOME}"}}},
     400, "unknown_placeholder", "placeholders the running config does not use: ${HOME}", None),
    ("local", {"name": "other", "model": "m"}, 400, "name_mismatch", "the body names provider 'other'",
     "name"),
    ("secret",
     {"settings": {"endpoint": "http://127.0.0.1:8090/v1", "auth": {"scheme": "bearer", "api_key": MASK}}},
     400, "redacted_value", "settings.auth.api_key: the value is the redaction mask",
     "settings.auth.api_key"),
])
async def test_refused_posts_change_nothing(tmp_path, name, body, status, code, message, param):
    rig = ProvidersRig(tmp_path)
    before = rig.path.read_bytes()
    resp = await rig.client.post(f"/v1/providers/{name}", json=body)
    assert resp.status_code == status
    err = error_of(resp)
    assert err["message"].startswith(message) and (err["code"], err["param"]) == (code, param)
    assert rig.path.read_bytes() == before and rig.reloads == 0


async def test_redacted_get_posted_back_is_refused_until_resupplied(tmp_path):
    """Spec 004, Secrets caveat."""
    rig = ProvidersRig(tmp_path)
    before = rig.path.read_bytes()
    shown = (await rig.client.get("/v1/providers/secret")).json()
    resp = await rig.client.post("/v1/providers/secret", json=shown)
    assert resp.status_code == 400
    assert "re-supply the real value or a ${VAR} placeholder" in error_of(resp)["message"]
    assert rig.path.read_bytes() == before
    # Re-supplied: the real values for the header and the URL. A placeholder the config uses
    # for another origin (LLAMA_KEY goes to 127.0.0.1:8089) may not be sent to this one.
    shown["settings"]["auth"]["api_key"] = "${LLAMA_KEY}"
    shown["settings"]["auth"]["custom_headers"]["x-api-key"] = "hdr-secret"
    shown["metrics"]["url"] = "http://scraper:pw@127.0.0.1:8090/metrics"
    resp = await rig.client.post("/v1/providers/secret", json=shown)
    assert resp.status_code == 400 and error_of(resp)["code"] == "secret_origin_changed"
    assert error_of(resp)["param"] == "settings.auth.api_key"
    assert rig.path.read_bytes() == before
    shown["settings"]["auth"]["api_key"] = "sk-new"
    resp = await rig.client.post("/v1/providers/secret", json=shown)
    assert resp.status_code == 200, resp.text
    assert rig.loaded.config.providers[2].settings.auth.api_key == "sk-new"
    assert rig.on_disk()["providers"][2]["settings"]["auth"]["api_key"] == "sk-new"


@pytest.mark.parametrize(("method", "path", "status", "allow"), [
    ("PUT", "/v1/providers/local", 405, "GET, POST, DELETE"),
    ("PATCH", "/v1/providers/local", 405, "GET, POST, DELETE"),
    ("POST", "/v1/providers", 405, "GET"),
    ("DELETE", "/v1/providers", 405, "GET"),
    ("GET", "/v1/providers/", 404, None),
    ("GET", "/v1/providers/local/probes", 404, None),
    ("GET", "/v1/models", 404, None),
    ("GET", "/", 404, None),
])
async def test_routes(tmp_path, method, path, status, allow):
    rig = ProvidersRig(tmp_path)
    resp = await rig.client.request(method, path)
    assert resp.status_code == status
    assert error_of(resp)["code"] == ("method_not_allowed" if status == 405 else "not_found")
    assert resp.headers.get("allow") == allow


@pytest.mark.parametrize(("content", "message"), [
    (b"{", "the request body is not valid JSON"),
    (b"", "the request body is not valid JSON"),
    (b"[1, 2]", "the request body must be a JSON object"),
    (b'"settings"', "the request body must be a JSON object"),
    (b"[" * 10000 + b"]" * 10000, "the request body "),
])
async def test_malformed_json_is_400(tmp_path, content, message):
    rig = ProvidersRig(tmp_path)
    resp = await rig.client.post("/v1/providers/local", headers=JSON, content=content)
    assert resp.status_code == 400
    err = error_of(resp)
    assert err["message"].startswith(message) and err["code"] == "invalid_json"


@pytest.mark.parametrize(("levels", "code"),
                         [(31, "invalid_config"), (32, "invalid_json"), (400, "invalid_json")])
async def test_nesting_bound(tmp_path, levels, code):
    """32 levels of containers pass the JSON check (and fail as config); deeper is refused
    before anything recursive (copy, YAML dump) sees it."""
    rig = ProvidersRig(tmp_path)
    body = b'{"metadata": ' + b'{"a": ' * levels + b"1" + b"}" * levels + b"}"
    resp = await rig.client.post("/v1/providers/local", headers=JSON, content=body)
    assert resp.status_code == 400 and error_of(resp)["code"] == code


async def test_body_cap(tmp_path):
    rig = ProvidersRig(tmp_path, max_body_bytes=64)
    at_cap = b'{"enabled": true' + b" " * (64 - 17) + b"}"
    assert len(at_cap) == 64
    assert (await rig.client.post("/v1/providers/local", headers=JSON, content=at_cap)).status_code == 200
    over = await rig.client.post("/v1/providers/local", headers=JSON, content=at_cap + b" ")
    assert over.status_code == 413 and error_of(over)["code"] == "request_too_large"
    (tmp_path / "default").mkdir()
    default = ProvidersRig(tmp_path / "default")
    huge = await default.client.post("/v1/providers/local", headers=JSON,
                                     content=b'{"model": "' + b"x" * (1024 * 1024) + b'"}')
    assert huge.status_code == 413


async def test_rejected_reload_restores_the_file(tmp_path):
    rig = ProvidersRig(tmp_path)
    os.chmod(rig.path, 0o640)
    before, loaded = rig.path.read_bytes(), rig.loaded
    rig.reject = "listen.signals: changed; restart gridd to apply"
    resp = await rig.client.post("/v1/providers/local", json=EXAMPLE_2)
    assert resp.status_code == 409
    err = error_of(resp)
    assert err["code"] == "reload_rejected"
    assert err["message"].endswith(
        "the previous file is restored: listen.signals: changed; restart gridd to apply")
    # Byte for byte, comments included, and with its permission bits.
    assert rig.path.read_bytes() == before and rig.loaded is loaded
    assert stat.S_IMODE(os.stat(rig.path).st_mode) == 0o640


async def test_write_keeps_the_file_mode_and_drops_comments(tmp_path):
    rig = ProvidersRig(tmp_path)
    os.chmod(rig.path, 0o640)
    assert (await rig.client.post("/v1/providers/local", json=EXAMPLE_2)).status_code == 200
    assert stat.S_IMODE(os.stat(rig.path).st_mode) == 0o640
    text = rig.path.read_text()
    assert "# The operator" not in text and not (tmp_path / ".operator.yaml.tmp").exists()


async def test_file_edited_and_not_reloaded_is_not_overwritten(tmp_path):
    rig = ProvidersRig(tmp_path)
    edited = rig.path.read_text().replace("cost: 0", "cost: 7")
    rig.path.write_text(edited)
    resp = await rig.client.post("/v1/providers/local", json=EXAMPLE_2)
    assert resp.status_code == 409 and error_of(resp)["code"] == "config_changed_on_disk"
    assert rig.path.read_text() == edited and rig.reloads == 0
    rig.loaded = load_config(rig.path, env=ENV)  # what `gridctl reload` would do
    assert (await rig.client.post("/v1/providers/local", json=EXAMPLE_2)).status_code == 200
    assert rig.on_disk()["providers"][0]["metadata"]["cost"] == 7


async def test_concurrent_mutations_are_serialized(tmp_path):
    rig = ProvidersRig(tmp_path)
    rig.reload_delay_s = 0.05
    statuses: list[int] = []

    async def create(name: str) -> None:
        resp = await rig.client.post(f"/v1/providers/{name}",
                                     json={"model": name, "settings": {"endpoint": "http://127.0.0.1:9/v1"}})
        statuses.append(resp.status_code)

    async with trio.open_nursery() as nursery:
        for name in ("one", "two", "three"):
            nursery.start_soon(create, name)
    assert statuses == [201, 201, 201] and rig.reloads == 3
    names = {p["name"] for p in rig.on_disk()["providers"]}
    assert names == {"local", "keyed", "secret", "one", "two", "three"}


async def test_admin_token(tmp_path):
    rig = ProvidersRig(tmp_path, api="api: {admin_token: \"${ADMIN_TOKEN}\"}\n")
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Basic s3cret-admin"}):
        for method, path in (("GET", "/v1/providers"), ("POST", "/v1/providers/local"), ("GET", "/nowhere")):
            resp = await rig.anonymous.request(method, path, headers=headers, json=EXAMPLE_2)
            assert resp.status_code == 401, (headers, method, path)
            assert resp.headers["www-authenticate"].startswith("Bearer ")
            assert error_of(resp)["type"] == "authentication_error"
    assert rig.reloads == 0
    good = {"authorization": "Bearer s3cret-admin"}
    assert (await rig.anonymous.get("/v1/providers", headers=good)).status_code == 200
    assert (await rig.anonymous.post("/v1/providers/local", headers=good, json=EXAMPLE_2)).status_code == 200
    # The token file's token is as good as the admin token (both are secrets of the host).
    assert (await rig.client.get("/v1/providers")).status_code == 200


async def test_operator_stage_guards_the_api(tmp_path, monkeypatch):
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)  # the operator's API reads the process environment
    (tmp_path / "operator.yaml").write_text(CONFIG.format(api=""))
    operator = OperatorService(load_config(tmp_path / "operator.yaml", env=ENV), CollectorRegistry())
    # A write applies through the daemon's reload: with no daemon attached it is rejected.
    operator.api_token = WRITE_TOKEN
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=operator.api), base_url="http://127.0.0.1",
                                 headers={"authorization": f"Bearer {WRITE_TOKEN}"}) as client:
        resp = await client.post("/v1/providers/local", json=EXAMPLE_2)
    assert resp.status_code == 409, resp.text
    assert error_of(resp)["message"].endswith("no daemon is attached to reload this operator")
    assert (tmp_path / "operator.yaml").read_text() == CONFIG.format(api="")  # restored
    for old, new, message in (
        ("127.0.0.1:0", "127.0.0.1:1", "listen.http: changed; restart gridd to apply"),
        ("127.0.0.1:0", "0.0.0.0:0", "api.admin_token: required when the providers API listens"),
        ("state_dir: state", "state_dir: state\nlimits: {http_max_connections: 5}",
         "limits.http_*: changed; restart gridd to apply"),
    ):
        (tmp_path / "next.yaml").write_text(CONFIG.format(api="").replace(old, new))
        with pytest.raises(ConfigError, match=re.escape(message)):
            await operator.stage(load_config(tmp_path / "next.yaml", env=ENV))


# ---------------------------------------------------------------------------------------------
# A real operator process







@pytest.mark.realproc
def test_real_operator_serves_the_providers_api(tmp_path):
    sim_port, api_port = free_ports(2)
    config = (CONFIG.format(api='api: {admin_token: "${ADMIN_TOKEN}"}\n')
              .replace("127.0.0.1:0", f"127.0.0.1:{api_port}")
              .replace("localhost:8088", f"127.0.0.1:{sim_port}"))
    config = config.replace("state_dir: state", "state_dir: state\ncontrol_socket: run/op.sock")
    path = tmp_path / "operator.yaml"
    path.write_text(config)
    env = {**os.environ, **ENV}
    base = f"http://127.0.0.1:{api_port}"
    auth = {"authorization": "Bearer s3cret-admin"}
    example = json.loads(json.dumps(EXAMPLE_2).replace("localhost:8088", f"127.0.0.1:{sim_port}"))
    procs = []
    try:
        procs.append(start_gridd("sim", "--flavour", "vllm", "--port", str(sim_port), env=env))
        operator = start_gridd("run", "--config", str(path), env=env, stderr=subprocess.PIPE)
        procs.append(operator)
        sock = tmp_path / "run" / "op.sock"
        # The control socket answers from the start, before the role's listeners are up.
        status = wait_until(lambda: (s := gridctl_status(sock)) and s["state"] == "serving" and s,
                          "the operator serving")
        assert status["role_status"]["providers_api"] == {"listen": [base], "auth": "bearer",
                                                          "token_file": str(tmp_path / "state" / "api-token")}
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{sim_port}/metrics").status_code == 200,
                   "the simulator")

        with httpx.Client(base_url=base, timeout=30) as client:
            assert client.get("/v1/providers").status_code == 401
            assert client.get("/v1/providers", headers={"authorization": "Bearer nope"}).status_code == 401

            # Example 2: the probe, posted at runtime, starts without a restart.
            resp = client.post("/v1/providers/local", headers=auth, json=example)
            assert resp.status_code == 200, resp.text
            got = client.get("/v1/providers/local", headers=auth).json()
            assert got["settings"]["probes"] == example["settings"]["probes"]
            assert got["model"] == "Qwen/Qwen3.5-9B"
            on_disk = yaml.safe_load(path.read_text())
            assert on_disk["providers"][0]["settings"]["probes"][0]["name"] == "perf"
            assert on_disk["providers"][1]["settings"]["auth"]["api_key"] == "${LLAMA_KEY}"
            assert "${ADMIN_TOKEN}" in path.read_text() and "s3cret-admin" not in path.read_text()

            def probe_ticked():
                st = gridctl_status(sock)
                local = next(p for p in st["role_status"]["providers"] if p["name"] == "local")
                probe = local["probes"][0]
                return probe if probe["running"] and probe["ticks"] >= 1 and probe["state"] == "ok" else None

            probe = wait_until(probe_ticked, "the posted probe to run")
            assert probe["name"] == "perf" and probe["endpoint"] == f"http://127.0.0.1:{sim_port}/metrics"
            assert gridctl_status(sock)["last_reload"]["source"] == "providers API"
            assert (tmp_path / "probes" / "local.perf.jsonl").exists()

            # settings only: model kept, settings replaced whole (the probe stops).
            resp = client.post("/v1/providers/local", headers=auth,
                               json={"settings": {"endpoint": f"http://127.0.0.1:{sim_port}/v1"}})
            assert resp.status_code == 200 and resp.json()["model"] == "Qwen/Qwen3.5-9B"
            assert client.get("/v1/providers/local", headers=auth).json()["settings"] == {
                "endpoint": f"http://127.0.0.1:{sim_port}/v1"}

            # The redacted GET posted back, and an invalid interval: 400, file unchanged.
            before = path.read_bytes()
            shown = client.get("/v1/providers/secret", headers=auth).json()
            assert shown["settings"]["auth"]["api_key"] == MASK
            resp = client.post("/v1/providers/secret", headers=auth, json=shown)
            assert resp.status_code == 400 and resp.json()["error"]["code"] == "redacted_value"
            bad = copy.deepcopy(example)
            bad["settings"]["probes"][0]["interval"] = -1
            resp = client.post("/v1/providers/local", headers=auth, json=bad)
            assert resp.status_code == 400
            assert resp.json()["error"]["message"] == (
                "providers[0].settings.probes[0].interval: expected a number >= 0.1, got -1")
            assert path.read_bytes() == before

            assert client.delete("/v1/providers/local", headers=auth).status_code == 204
            assert client.get("/v1/providers/local", headers=auth).status_code == 404
            names = [p["name"] for p in gridctl_status(sock)["role_status"]["providers"]]
            assert names == ["keyed", "secret"]

        operator.send_signal(signal.SIGTERM)
        assert operator.wait(timeout=20) == 0
        assert "stopped" in operator.stderr.read()
    finally:
        stop_processes(procs, grace_s=10)


@pytest.mark.realproc
def test_operator_without_token_refuses_a_non_loopback_api(tmp_path):
    path = tmp_path / "operator.yaml"
    path.write_text(CONFIG.format(api="").replace("127.0.0.1:0", "0.0.0.0:0")
                    .replace("state_dir: state", "state_dir: state\ncontrol_socket: run/op.sock"))
    out = subprocess.run([sys.executable, "-m", "gridd", "run", "--config", str(path)], capture_output=True,
                         text=True, timeout=60, env={**os.environ, **ENV})
    assert out.returncode == 1
    assert "api.admin_token: required when the providers API listens beyond loopback" in out.stderr


# ---------------------------------------------------------------------------------------------
# Security (docs/security.md): secrets bound to their origin, writes always authenticated


@pytest.mark.parametrize(("url", "shown"), [
    ("http://u:p[w]@h:1/m", f"http://u:{MASK}@h:1/m"),  # urllib refuses it as an IPv6 literal
    ("http://h/m?sig=abc&x=1", f"http://h/m?sig={MASK}&x=1"),
    ("http://h/m?pwd=abc", f"http://h/m?pwd={MASK}"),
    ("http://h/m?jwt=abc", f"http://h/m?jwt={MASK}"),
    ("http://h/m#access_token=abc", f"http://h/m#{MASK}"),
    ("http://h/m#${FRAG}", "http://h/m#${FRAG}"),
    ("http://[::1]:8/m?x=1", "http://[::1]:8/m?x=1"),
])
def test_url_masking_gaps_closed(url, shown):
    assert redact_provider({"metrics": {"url": url}})["metrics"]["url"] == shown


@pytest.mark.parametrize(("name", "body", "param"), [
    # A stored literal key, a new metrics origin given its own auth naming no new secret: the
    # provider's key stays home; but moving the endpoint keeps the key only if re-supplied.
    ("secret", {"settings": {"endpoint": "http://evil.example/v1",
                             "auth": {"scheme": "bearer", "api_key": "${LLAMA_KEY}"}}},
     "settings.auth.api_key"),
    # A placeholder the config uses, put into another origin's query string.
    ("keyed", {"metrics": {"url": "http://evil.example/m?k=${LLAMA_KEY}"}}, "metrics.url"),
    ("keyed", {"metrics": {"url": "http://127.0.0.1:8089/m",
                           "auth": {"scheme": "bearer", "api_key": "${LLAMA_KEY}"}}}, None),
    ("keyed", {"metrics": {"url": "http://127.0.0.1:9/m",
                           "auth": {"scheme": "bearer", "api_key": "${LLAMA_KEY}"}}}, "metrics.auth.api_key"),
    ("keyed", {"settings": {"endpoint": "http://127.0.0.1:8089/v1", "auth": {"scheme": "bearer",
               "api_key": "${LLAMA_KEY}"}, "probes": [{"name": "p", "endpoint": "http://evil.example/x",
               "extract": [{"json": "$.a"}], "auth": {"scheme": "bearer", "api_key": "${LLAMA_KEY}"}}]}},
     "settings.probes[0].auth.api_key"),
    # A new provider may use a placeholder only where the config already sends it.
    ("fresh", {"model": "m", "settings": {"endpoint": "http://127.0.0.1:8089/v1",
               "auth": {"scheme": "bearer", "api_key": "${LLAMA_KEY}"}}}, None),
    ("fresh", {"model": "m", "settings": {"endpoint": "http://evil.example:8089/v1",
               "auth": {"scheme": "bearer", "api_key": "${LLAMA_KEY}"}}}, "settings.auth.api_key"),
    # A stored URL password (metrics of "secret") kept while the URL moves is impossible: the URL
    # is in the body; given in full it is the caller's own secret.
    ("secret", {"metrics": {"url": "http://scraper:pw@evil.example/metrics"}}, None),
    # The endpoint moved with the key re-supplied in full: accepted.
    ("secret", {"settings": {"endpoint": "http://evil.example/v1",
                             "auth": {"scheme": "bearer", "api_key": "sk-literal"}}}, None),
])
async def test_secret_bound_to_origin(tmp_path, name, body, param):
    rig = ProvidersRig(tmp_path)
    before = rig.path.read_bytes()
    resp = await rig.client.post(f"/v1/providers/{name}", json=body)
    if param is None:
        assert resp.status_code in (200, 201), resp.text
        return
    assert resp.status_code == 400, resp.text
    err = error_of(resp)
    assert (err["code"], err["param"]) == ("secret_origin_changed", param)
    assert rig.path.read_bytes() == before and rig.reloads == 0


def test_secret_bindings_of_a_provider():
    provider = {"settings": {"endpoint": "https://h/v1", "auth": {"scheme": "bearer", "api_key": "${K}",
                                                                  "custom_headers": {"x-t": "lit"}}},
                "metrics": {"url": "http://epp:9090/metrics?token=abc"}}
    assert secret_bindings(provider) == {
        ("var", "K", "https://h:443"): "settings.auth.api_key",
        ("lit", "lit", "https://h:443"): "settings.auth.custom_headers.x-t",
        ("lit", "abc", "http://epp:9090"): "metrics.url",
    }


@pytest.mark.parametrize(("headers", "status", "code"), [
    # The cross-site write: text/plain (no CORS preflight), Origin and Host of the page.
    ({"content-type": "text/plain", "origin": "http://evil.example", "host": "evil.example"}, 403,
     "cross_origin_refused"),
    ({"content-type": "application/json", "origin": "http://127.0.0.1"}, 403, "cross_origin_refused"),
    ({"content-type": "text/plain"}, 401, "invalid_api_key"),  # no token: never a write
    ({"content-type": "application/json"}, 401, "invalid_api_key"),
    ({"content-type": "text/plain", "authorization": f"Bearer {WRITE_TOKEN}"}, 415, "unsupported_media_type"),
    ({"content-type": "application/x-www-form-urlencoded", "authorization": f"Bearer {WRITE_TOKEN}"}, 415,
     "unsupported_media_type"),
    ({"authorization": f"Bearer {WRITE_TOKEN}"}, 415, "unsupported_media_type"),
])
async def test_writes_need_a_token_and_json_and_no_origin(tmp_path, headers, status, code):
    rig = ProvidersRig(tmp_path)
    before = rig.path.read_bytes()
    resp = await rig.anonymous.post("/v1/providers/local", headers=headers, content=json.dumps(EXAMPLE_2))
    assert resp.status_code == status and error_of(resp)["code"] == code
    resp = await rig.anonymous.delete("/v1/providers/local", headers={k: v for k, v in headers.items()
                                                                     if k != "content-type"})
    expected = 403 if "origin" in headers else 401 if "authorization" not in headers else 204
    assert resp.status_code == expected
    if resp.status_code != 204:
        assert rig.path.read_bytes() == before and rig.reloads == 0


@pytest.mark.parametrize(("host", "status"), [
    ("127.0.0.1:9180", 200), ("localhost", 200), ("[::1]:9180", 200), ("LOCALHOST:1", 200),
    ("evil.example", 403), ("evil.example:9180", 403), ("10.0.0.1:9180", 403),
])
async def test_loopback_reads_need_a_loopback_host(tmp_path, host, status):
    """A DNS-rebinding page reads with its own name in Host; without a token that is refused."""
    rig = ProvidersRig(tmp_path)
    resp = await rig.anonymous.get("/v1/providers", headers={"host": host})
    assert resp.status_code == status
    with_token = await rig.client.get("/v1/providers", headers={"host": host})
    assert with_token.status_code == 200  # token: any Host


def test_api_token_file(tmp_path):
    from gridd.state import StateDir
    state = StateDir(tmp_path / "state")
    token = state.api_token()
    path = tmp_path / "state" / "api-token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(token) >= 40
    assert state.api_token() == token  # read again at the next start
    path.chmod(0o644)
    with pytest.raises(StateError, match="mode 0644; make it 0600"):
        state.api_token()
