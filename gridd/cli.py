"""Entry points: ``gridd`` (run, check-config, sim, certs, demo) and ``gridctl`` (status, reload,
clear-feedback, explain, watch, providers)."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
from typing import Any

from gridd import __version__

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


def _gridd_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gridd", description="Load-aware, cross-site router for LLM inference fleets."
    )
    parser.add_argument("--version", action="version", version=f"gridd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = sub.add_parser("run", help="run the daemon (operator or gateway, from the config's role)")
    run.add_argument("--config", help="config file (default: $GRIDD_CONFIG, or $GATEWAY_CONFIG)")
    check = sub.add_parser("check-config", help="validate a config file: exit 0 if valid, 2 if not")
    check.add_argument("file", nargs="?", help="config file (default: $GRIDD_CONFIG, or $GATEWAY_CONFIG)")
    sub.add_parser("sim", help="run a simulated EPP/vLLM backend (gridd sim --help)", add_help=False)
    sub.add_parser("certs", help="make a grid CA and issue certificates (gridd certs --help)", add_help=False)
    sub.add_parser("demo", help="run a local demo grid with simulated backends (gridd demo --help)",
                   add_help=False)
    return parser


def _config_path(arg: str | None) -> str | None:
    from gridd.config import config_from_env

    return arg or config_from_env(os.environ)


def gridd_main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Subcommands with parsers of their own get the rest of the line untouched.
    if argv and argv[0] == "sim":
        from gridd.sim.cli import main as sim_main

        return sim_main(argv[1:])
    if argv and argv[0] == "certs":
        from gridd.certs import main as certs_main

        return certs_main(argv[1:])
    if argv and argv[0] == "demo":
        from gridd.demo import main as demo_main

        return demo_main(argv[1:])
    parser = _gridd_parser()
    args = parser.parse_args(argv)
    if args.command == "check-config":
        return _check_config(_config_path(args.file))
    if args.command == "run":
        return _run(_config_path(args.config))
    parser.print_help()
    return EXIT_USAGE


def _check_config(path: str | None) -> int:
    from gridd.config import load_config
    from gridd.errors import ConfigError
    from gridd.preflight import check_runnable

    if path is None:
        print("gridd check-config: no config file given (argument, $GRIDD_CONFIG or $GATEWAY_CONFIG)",
              file=sys.stderr)
        return EXIT_USAGE
    try:
        loaded = load_config(path)
        # What `gridd run` would refuse at start: listen addresses, the role's rules, TLS.
        notes = check_runnable(loaded, time.time())
    except ConfigError as exc:
        message = str(exc)
        shown = str(pathlib.Path(path))
        print(f"invalid config: {message if message.startswith(f'{shown}:') else f'{shown}: {message}'}",
              file=sys.stderr)
        return EXIT_USAGE
    cfg = loaded.config
    print(f"{path}: ok ({cfg.role} for site {cfg.site}, {len(cfg.providers)} providers, "
          f"{len(cfg.peers)} peers)")
    for note in notes:
        print(f"note: {note}")
    return EXIT_OK


def _run(path: str | None) -> int:
    import trio

    from gridd.clock import OFFSET_ENV, wall_clock_offset_s
    from gridd.config import load_config
    from gridd.daemon import Daemon
    from gridd.errors import GriddError
    from gridd.log import setup_logging

    setup_logging()
    import logging

    log = logging.getLogger("gridd")
    if path is None:
        log.error("no config file given (--config, $GRIDD_CONFIG or $GATEWAY_CONFIG)")
        return EXIT_USAGE
    try:
        loaded = load_config(path)
        clock_offset_s = wall_clock_offset_s()
    except GriddError as exc:
        log.error("cannot start: %s", exc)
        return EXIT_USAGE
    setup_logging(loaded.config.log_level)
    if clock_offset_s:
        log.warning("wall clock shifted by %+g s (%s, a test aid): epochs, published times and "
                    "the skew bound read the shifted clock", clock_offset_s, OFFSET_ENV)
    try:
        daemon = Daemon(loaded)
        trio.run(daemon.run)
    except GriddError as exc:
        log.error("cannot run: %s", exc)
        return EXIT_FAIL
    except KeyboardInterrupt:
        log.warning("interrupted")
        return EXIT_FAIL
    return EXIT_OK


# -- gridctl ------------------------------------------------------------------------------------


def _gridctl_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gridctl", description="Inspect and steer a running gridd.")
    parser.add_argument("--socket", help="control socket (default: from --config, $GRIDD_SOCKET, "
                                         "else $RUNTIME_DIRECTORY/gridd.sock or /run/gridd/gridd.sock)")
    parser.add_argument("--config", help="read the control socket path from this config file")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    status = sub.add_parser("status", help="show role, uptime, config, reloads, tasks, providers")
    status.add_argument("--json", action="store_true", help="print JSON")
    reload = sub.add_parser("reload", help="reload the config file (staged: a bad file changes nothing)")
    reload.add_argument("--json", action="store_true", help="print JSON")
    clear = sub.add_parser("clear-feedback",
                           help="operator: resolve GatewayAgesRejected (one replica or all)")
    clear.add_argument("--replica", help="the gateway replica (default: every replica)")
    clear.add_argument("--json", action="store_true", help="print JSON")
    providers = sub.add_parser("providers",
                               help="operator: read or change providers through the providers API "
                                    "(with the token file's token)")
    providers.add_argument("action", choices=("list", "get", "set", "delete"))
    providers.add_argument("name", nargs="?", help="the provider (get, set, delete)")
    providers.add_argument("--file", help="set: the JSON body (default: standard input)")
    explain = sub.add_parser("explain",
                             help="gateway: why MODEL routes as it does (candidates, chances, reasons)")
    explain.add_argument("model", help="the model name requests carry")
    explain.add_argument("--json", action="store_true", help="print JSON")
    watch = sub.add_parser("watch", help="refresh `status` or `explain MODEL` in place until Ctrl-C")
    watch.add_argument("view", nargs="*", metavar="status | explain MODEL",
                       help="what to show (default: status)")
    watch.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default: 2)")
    watch.add_argument("--count", type=int, default=None, help="stop after this many refreshes")
    watch.add_argument("--json", action="store_true", help="print one JSON answer per line, no redraw")
    return parser


def _providers_call(status: dict[str, Any], args: argparse.Namespace) -> tuple[int, Any]:
    """One providers API request, authenticated with the token file gridd made in its state
    directory (docs/security.md). Returns (HTTP status, decoded body or None)."""
    import httpx

    from gridd.errors import ControlError

    api = (status.get("role_status") or {}).get("providers_api") or {}
    urls, token_file = api.get("listen") or [], api.get("token_file")
    if not urls or not token_file:
        raise ControlError("this gridd serves no providers API (an operator with listen.http)")
    try:
        token = pathlib.Path(token_file).read_text().strip()
    except OSError as exc:
        raise ControlError(f"{token_file}: cannot read the API token: {exc.strerror or exc} "
                           "(run gridctl as gridd's user)") from None
    if args.action != "list" and not args.name:
        raise ControlError(f"providers {args.action}: name the provider")
    path = "/v1/providers" + (f"/{args.name}" if args.action != "list" else "")
    method = {"list": "GET", "get": "GET", "set": "POST", "delete": "DELETE"}[args.action]
    body = None
    if method == "POST":
        body = pathlib.Path(args.file).read_bytes() if args.file else sys.stdin.buffer.read()
    headers = {"authorization": f"Bearer {token}", "content-type": "application/json"}
    try:
        resp = httpx.request(method, urls[0] + path, headers=headers, content=body, timeout=30.0)
    except httpx.HTTPError as exc:
        raise ControlError(f"{urls[0]}: {exc}") from None
    return resp.status_code, resp.json() if resp.content else None


def _socket_path(args: argparse.Namespace) -> pathlib.Path:
    from gridd.config import config_from_env, default_control_socket, load_config

    if args.socket:
        return pathlib.Path(args.socket)
    if os.environ.get("GRIDD_SOCKET"):
        return pathlib.Path(os.environ["GRIDD_SOCKET"])
    config = args.config or config_from_env(os.environ)
    if config:
        loaded = load_config(config)
        return default_control_socket(loaded.config, loaded.workspace, dict(os.environ))
    return default_control_socket(None, None, dict(os.environ))


def gridctl_main(argv: list[str] | None = None) -> int:
    parser = _gridctl_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return _gridctl(parser, args)
    except BrokenPipeError:
        # The reader went away (`gridctl watch | head`): it took what it wanted. Point
        # stdout at /dev/null so the interpreter's final flush does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_OK


def _gridctl(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from gridd.control import request
    from gridd.errors import GriddError

    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    if args.command == "watch":
        return _watch(args)
    try:
        path = _socket_path(args)
        # providers: the status names the API's URL and token file; the call goes there.
        command = "status" if args.command == "providers" else args.command
        reply = request(path, command, **_command_args(args))
        if args.command == "providers" and reply.get("ok"):
            code, body = _providers_call(reply["status"], args)
            print(json.dumps(body, indent=2) if body is not None else f"HTTP {code}")
            return EXIT_OK if code < 300 else EXIT_FAIL
    except GriddError as exc:
        print(f"gridctl: {exc}", file=sys.stderr)
        return EXIT_FAIL
    except OSError as exc:
        print(f"gridctl: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_FAIL
    if getattr(args, "json", False):
        print(json.dumps(reply, indent=2, sort_keys=True, default=str))
    else:
        text = render_reply(args.command, reply)
        print(text, file=sys.stdout if reply.get("ok") or args.command == "reload" else sys.stderr)
    return EXIT_OK if reply.get("ok") else EXIT_FAIL


def _command_args(args: argparse.Namespace) -> dict[str, Any]:
    if args.command == "clear-feedback" and args.replica:
        return {"replica": args.replica}
    if args.command == "explain":
        return {"model": args.model}
    return {}


def render_reply(command: str, reply: dict[str, Any]) -> str:
    """The human form of a control-socket answer to ``command``."""
    if command == "status" and reply.get("ok"):
        return format_status(reply["status"])
    if command == "explain" and reply.get("ok"):
        return format_explain(reply["explain"])
    if command == "clear-feedback" and reply.get("ok"):
        return f"cleared: {', '.join(reply['cleared']) or 'nothing was unresolved'}"
    if command == "reload":
        outcome = reply.get("reload", {})
        if outcome.get("result") == "ok":
            return "reload: ok"
        return f"reload: rejected, old config kept: {outcome.get('error') or reply.get('error')}"
    return f"gridctl: {reply.get('error', 'failed')}"


# -- gridctl watch ------------------------------------------------------------------------------

CLEAR_SCREEN = "\x1b[H\x1b[2J"
"""Cursor home, erase the screen: each frame is drawn over the last (as watch(1) does)."""


def _watch(args: argparse.Namespace) -> int:
    from gridd.control import request
    from gridd.errors import GriddError

    view = args.view or ["status"]
    if view == ["status"]:
        command, extra = "status", {}
    elif len(view) == 2 and view[0] == "explain":
        command, extra = "explain", {"model": view[1]}
    else:
        print(f"gridctl watch: expected `status` or `explain MODEL`, got {' '.join(view)!r}", file=sys.stderr)
        return EXIT_USAGE
    if not (args.interval > 0) or (args.count is not None and args.count < 1):
        print("gridctl watch: --interval must be > 0 and --count >= 1", file=sys.stderr)
        return EXIT_USAGE
    try:
        path = _socket_path(args)
    except GriddError as exc:
        print(f"gridctl: {exc}", file=sys.stderr)
        return EXIT_FAIL

    def fetch() -> dict[str, Any]:
        try:
            return request(path, command, **extra)
        except GriddError as exc:  # gridd restarting: show it in the frame, keep watching
            return {"ok": False, "error": str(exc)}

    title = f"gridctl {' '.join(view)}"
    return watch_frames(fetch, lambda reply: render_reply(command, reply), title=title,
                        interval_s=args.interval,
                        count=args.count, as_json=args.json, out=sys.stdout,
                        clear=sys.stdout.isatty() and not args.json)


def watch_frames(fetch, render, *, title: str, interval_s: float, count: int | None, as_json: bool, out,
                 clear: bool, sleep=time.sleep, clock=time.monotonic, wall=time.time) -> int:
    """Fetch and draw a frame every ``interval_s`` (drift-free: frames start one interval
    apart, a slow answer skips ticks instead of bunching them), ``count`` frames or until
    Ctrl-C, which ends it cleanly with exit 0. ``clear``: draw each frame over the last
    (a terminal); otherwise frames follow each other under their title line. Exit 1 when
    the last answer was an error (after --count frames)."""
    frames, ok = 0, False
    next_at = clock()
    try:
        while True:
            reply = fetch()
            ok = bool(reply.get("ok"))
            if as_json:
                out.write(json.dumps(reply, sort_keys=True, default=str) + "\n")
            else:
                stamp = time.strftime("%H:%M:%S", time.localtime(wall()))
                out.write(f"{CLEAR_SCREEN if clear else ''}every {interval_s:g}s: {title}    {stamp}\n\n"
                          f"{render(reply)}\n")
            out.flush()
            frames += 1
            if count is not None and frames >= count:
                break
            next_at = max(next_at + interval_s, clock())
            sleep(max(0.0, next_at - clock()))
    except KeyboardInterrupt:
        out.write("\n")
        out.flush()
        return EXIT_OK
    return EXIT_OK if ok else EXIT_FAIL


def _age(ts: float | None) -> str:
    if ts is None:
        return "never"
    return f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(ts))} ({time.time() - ts:.0f}s ago)"


def _fmt(value: Any, spec: str = "") -> str:
    if value is None:
        return "-"
    return format(value, spec) if spec else str(value)


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}s"


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    if not rows:
        return []
    cells = [header, *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return [""] + ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]


def _provider_row(p: dict[str, Any]) -> list[Any]:
    latency = p.get("latency") or {}
    ttft = "-"
    if latency.get("ttft_p50_s") is not None:
        ttft = f"{latency['ttft_p50_s']:.3f}/{_fmt(latency.get('ttft_p90_s'), '.3f')}"
    kv = "-" if p.get("kv_mean") is None else f"{p['kv_mean']:.2f}±{_fmt(p.get('kv_spread'), '.2f')}"
    ready = {True: "yes", False: "NO", None: "unknown"}[p.get("ready")]
    failure = p.get("failure_class")
    if failure is None and p.get("invalid_fields"):
        # The scrape succeeded but fields were left out as out of range (published absent).
        failure = "invalid:" + ",".join(p["invalid_fields"])
    return [p["name"], ready, p.get("reason", "-"), _fmt(p.get("ready_endpoints")),
            _fmt(p.get("in_flight"), ".1f"),
            kv, ttft, _fmt(latency.get("error_ratio"), ".3f"), _secs(p.get("scrape_age_s")) + " ago",
            _fmt(failure)]


def _metadata_table(rows: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Probe metadata (spec 004), one line per value, with its age: what strategies read."""
    return _table(["PROVIDER", "METADATA", "VALUE", "AGE"], [
        [name, key, f"{value:g}", _secs((item.get("metadata_age_s") or {}).get(key))]
        for name, item in rows for key, value in sorted((item.get("metadata") or {}).items())])


def format_status(s: dict[str, Any]) -> str:
    lines = [
        f"role        {s['role']}",
        f"site        {s['site']}",
        f"state       {s['state']}  (pid {s['pid']}, up {s['uptime_s']:.0f}s, gridd {s['version']})",
        *([f"degraded    {s['role_status']['degraded']}"]
          if (s.get("role_status") or {}).get("degraded") else []),
        f"config      {s['config_file']}",
        f"loaded      {_age(s['config_loaded_at'])}",
    ]
    lr = s["last_reload"]
    reload_line = f"last reload {lr['result']}"
    if lr.get("at"):
        reload_line += f" via {lr['source']} at {_age(lr['at'])}"
    if lr.get("error"):
        reload_line += f": {lr['error']}"
    lines.append(reload_line)
    if s.get("metrics"):
        lines.append(f"metrics     {', '.join(s['metrics'])}")
    lines.append(f"tasks       {', '.join(s['tasks'])}")
    role = s.get("role_status") or {}
    if s["role"] == "operator":
        lines.append(f"epoch       {role.get('publisher_epoch')}  "
                     f"(stale after {role.get('stale_after_s')} s, "
                     f"last pass {role.get('last_pass_s')} s)")
        api = role.get("providers_api") or {}
        if api.get("listen"):
            lines.append(f"api         {api['listen']}  (auth: {api.get('auth')})")
        lines += _table(["PROVIDER", "READY", "REASON", "ENDPOINTS", "IN-FLIGHT", "KV", "TTFT p50/p90", "ERR",
                         "SCRAPED", "FAILURE"], [_provider_row(p) for p in role.get("providers", [])])
        probes = [(p["name"], q) for p in role.get("providers", []) for q in p.get("probes") or []]
        lines += _table(["PROVIDER", "PROBE", "STATE", "TICKS", "FAILURES", "SERIES", "LAST OK"], [
            [name, q["name"], q.get("state", "-"), q.get("ticks", "-"),
             sum((q.get("failures") or {}).values()),
             q.get("series", "-"), _secs(q.get("last_success_age_s"))] for name, q in probes])
        lines += _metadata_table([(p["name"], p) for p in role.get("providers", [])])
        feedback = (role.get("gateway_feedback") or {}).get("conditions") or []
        lines += _table(["GATEWAY", "AGES REJECTED", "REASON", "MESSAGE"], [
            [c.get("replica", "-"), c.get("status", "-"), c.get("reason", "-"), c.get("message", "")]
            for c in feedback])
        lines += _table(["PEER", "STATE", "LAST OK", "ERROR", "POLLS", "FAILURES", "URL"], [
            [p["site"], p["state"], _secs(p.get("last_success_age_s")), _fmt(p.get("last_error")),
             p.get("polls", 0), p.get("failures", 0), p["url"]] for p in role.get("peers", [])])
    else:
        lines.append(f"operator    {role.get('operator')}  ({role.get('operator_state')}"
                     + (f": {role['last_poll_error']}" if role.get("last_poll_error") else "") + ")")
        lines.append(f"front       {', '.join(role.get('front') or []) or '-'}")
        lines.append(f"models      {', '.join(role.get('models') or []) or '-'}")
        if role.get("shedding"):
            lines.append(f"shedding    {', '.join(role['shedding'])}")
        header = ["MODEL", "SITE", "PROVIDER", "AGE", "SIGNAL", "READY", "EXCLUDED", "RHO", "CAPACITY"]
        lines += _table(header, [
            [c["model"], c["site"], c["provider"], _secs(c.get("age_s")),
             _signal(c.get("signal")),
             {True: "yes", False: "NO", None: "unknown"}[c.get("ready")], _fmt(c.get("excluded")),
             _fmt(c.get("rho"), ".2f"), _fmt(c.get("capacity"), ".1f")] for c in role.get("candidates", [])])
        if role.get("strategies"):
            lines.append("")
            lines += [f"strategy    {model}: {name}" for model, name in sorted(role["strategies"].items())]
        lines += _metadata_table([(f"{c['site']}/{c['provider']}", c) for c in role.get("candidates", [])])
    return "\n".join(lines)


def _signal(state: str | None) -> str:
    """A candidate's signal state: ``fresh``, or the marker STALE / SILENT."""
    return "fresh" if state == "fresh" else str(state or "-").upper()


_TIER_SHOWN = {"room": "room", "not_full": "not full", "full": "FULL", "stale": "stale"}


def _explain_outcome(e: dict[str, Any]) -> str:
    o = e["outcome"]
    retry = "" if o.get("retry_after_s") is None else f"; Retry-After about {o['retry_after_s']:g} s"
    if o["kind"] == "forward":
        return f"forward: {o['message']}"
    if o["kind"] == "shed":
        return f"429 (shedding): {o['message']}{retry}"
    if o["kind"] == "unavailable":
        code = "no_routing_data" if o.get("cause") == "no_operator_data" else "model_unavailable"
        return f"503 {code} ({o.get('cause')}): {o['message']}{retry}"
    known = ", ".join(e.get("known_models") or []) or "none"
    return f"404: {o['message']} (models here: {known})"


def _explain_shedding(sh: dict[str, Any]) -> str:
    if not sh["enabled"]:
        return "off (availability.shedding.enabled: false): an all-full model is forwarded, never 429"
    line = "on: SHEDDING (429)" if sh["shedding"] else "on: not shedding"
    lasted = f" for {sh['run_for_s']:g} s" if sh.get("run_for_s") is not None else ""
    if sh.get("run") == "full":
        line += f"; every fresh healthy site is full: a full run under way{lasted}"
    elif sh.get("run") == "relief":
        line += f"; some fresh healthy site is not full: a relief run under way{lasted}"
    if sh.get("next_change_s") is not None:
        line += f" (next change in about {sh['next_change_s']:g} s)"
    return line


def format_explain(e: dict[str, Any]) -> str:
    """gridctl explain's human view: the model, what a request gets, a table of candidates
    (snapshot order) and one line per candidate saying why it stands where it does."""
    lines = [
        f"model       {e['model']}  (pick rule {e['pick_rule']}, pending weight {e['pending_weight']:g}, "
        f"signal TTL {e['signal_ttl_s']:g} s)",
        f"a request   {_explain_outcome(e)}",
        f"shedding    {_explain_shedding(e['shedding'])}",
        *([f"strategy    {e['strategy']}: filters and ranks the healthy candidates (reasons below)"]
          if e.get("strategy") else []),
    ]
    rows = []
    for c in e["candidates"]:
        cap = c["capacity"]
        pending = "-" if not c["pending_sends"] else f"{c['pending_sends']} +{c['pending_rho']:.2f}"
        rows.append([
            c["site"], c["provider"], "yes" if c["local"] else "no", _signal(c["signal"]), _secs(c["age_s"]),
            _fmt(c["excluded"]), _TIER_SHOWN.get(c["tier"], "-"), f"{c['weight']:.1f} {cap['bound']}",
            _fmt(c["in_flight"], ".1f"),
            _fmt(c["recent_worst_rho"] if c["signal"] == "fresh" else None, ".2f"),
            "yes" if c["full"] else "no", _fmt(c["queue_depth"], ".1f"), pending, f"{c['chance']:.1%}",
        ])
    lines += _table(["SITE", "PROVIDER", "LOCAL", "SIGNAL", "AGE", "EXCLUDED", "TIER", "CAPACITY",
                     "IN-FLIGHT", "RHO", "FULL", "QUEUE", "PENDING", "CHANCE"], rows)
    if e["candidates"]:
        lines.append("")
    lines += [f"{c['site']}/{c['provider']}: {c['reason']}" for c in e["candidates"]]
    return "\n".join(lines)
