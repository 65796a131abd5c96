"""``gridd demo``: a local demo grid with simulated backends, all real processes on loopback.

Two sites, a and b. Each has a simulated EPP (``gridd sim``), an operator that scrapes it
and peers with the other site's operator over mutual TLS, and a gateway serving the
OpenAI-compatible front. Certificates come from a fresh grid CA in the workspace. The
demo sends a short burst of chat completions through site a's gateway, prints where they
were served, then keeps the grid running until Ctrl-C (or --duration).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import pathlib
import subprocess
import sys
import tempfile
import time

import httpx

from gridd.childprocs import stop_processes

MODEL = "demo-model"


def _demo_ports(base: int) -> dict[str, int]:
    return {
        "gw-a": base, "gw-b": base + 1,
        "sig-a": base + 443, "sig-b": base + 444,
        "met-op-a": base + 100, "met-op-b": base + 101, "met-gw-a": base + 102, "met-gw-b": base + 103,
        "sim-a": base + 200, "sim-b": base + 201,
    }


def _write_configs(ws: pathlib.Path, ports: dict[str, int]) -> dict[str, pathlib.Path]:
    configs = {}
    for site, other in (("a", "b"), ("b", "a")):
        configs[f"op-{site}"] = ws / f"operator-{site}.yaml"
        configs[f"op-{site}"].write_text(f"""\
role: operator
site: {site}
tls: {{ca: certs/ca.pem, cert: certs/{site}-operator.pem, key: certs/{site}-operator-key.pem}}
listen:
  metrics: 127.0.0.1:{ports[f"met-op-{site}"]}
  signals: 127.0.0.1:{ports[f"sig-{site}"]}
control_socket: run/operator-{site}.sock
state_dir: state/operator-{site}
ingress: http://127.0.0.1:{ports[f"gw-{site}"]}
providers:
  - name: pool-{site}
    model: {MODEL}
    settings: {{endpoint: "http://127.0.0.1:{ports[f"sim-{site}"]}/v1"}}
    metrics: {{url: "http://127.0.0.1:{ports[f"sim-{site}"]}/metrics", timeout_s: 2}}
peers:
  - site: {other}
    url: wss://127.0.0.1:{ports[f"sig-{other}"]}/signals
    ingress: http://127.0.0.1:{ports[f"gw-{other}"]}
timings: {{peer_poll_interval_s: 2, peer_poll_budget_s: 4}}
""")
        configs[f"gw-{site}"] = ws / f"gateway-{site}.yaml"
        configs[f"gw-{site}"].write_text(f"""\
role: gateway
site: {site}
replica: g1
tls: {{ca: certs/ca.pem, cert: certs/{site}-gateway-g1.pem, key: certs/{site}-gateway-g1-key.pem}}
listen:
  http: 127.0.0.1:{ports[f"gw-{site}"]}
  metrics: 127.0.0.1:{ports[f"met-gw-{site}"]}
control_socket: run/gateway-{site}.sock
state_dir: state/gateway-{site}
operator: {{url: "wss://127.0.0.1:{ports[f"sig-{site}"]}/signals"}}
availability: {{shedding: {{enabled: true}}}}
""")
    return configs


def _gridd(*args: str, log: pathlib.Path | None = None) -> subprocess.Popen:
    out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115 - lives with the child
    return subprocess.Popen([sys.executable, "-m", "gridd", *args], stdout=out, stderr=out)


def _wait_ready(url: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not ready")


def _burst(gateway: str, n: int) -> collections.Counter:
    served: collections.Counter = collections.Counter()
    with httpx.Client(timeout=30.0) as client:
        for i in range(n):
            r = client.post(f"{gateway}/v1/chat/completions", json={
                "model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": f"hello {i}"}]})
            served[f"{r.status_code} via {r.headers.get('x-gridd-served-by', '?')}"] += 1
    return served


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gridd demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workspace",
                        help="where configs, certificates, state and logs go (default: a temp dir)")
    parser.add_argument("--base-port", type=int, default=18000, help="gateways listen on BASE and BASE+1")
    parser.add_argument("--requests", type=int, default=20, help="requests in the demo burst")
    parser.add_argument("--duration", type=float, default=None,
                        help="stop after this many seconds (default: run until Ctrl-C)")
    args = parser.parse_args(argv)
    ws = pathlib.Path(args.workspace or tempfile.mkdtemp(prefix="gridd-demo-")).resolve()
    ws.mkdir(parents=True, exist_ok=True)
    (ws / "logs").mkdir(exist_ok=True)
    from gridd.certs import main as certs_main

    with contextlib.redirect_stdout(io.StringIO()):
        if not (ws / "certs" / "ca.pem").exists() and certs_main(["init", str(ws / "certs")]) != 0:
            return 1
        for site in ("a", "b"):
            for role in (["--role", "operator"], ["--role", "gateway", "--replica", "g1"]):
                if certs_main(["issue", "--site", site, *role, str(ws / "certs")]) != 0:
                    return 1
    ports = _demo_ports(args.base_port)
    configs = _write_configs(ws, ports)
    procs: list[subprocess.Popen] = []
    try:
        # Site a's backend is twice the size of site b's.
        for site, endpoints in (("a", 4), ("b", 2)):
            procs.append(_gridd("sim", "--port", str(ports[f"sim-{site}"]), "--endpoints", str(endpoints),
                                "--max-seqs", "4", "--ttft-s", "0.05", "--tpot-s", "0.02", "--model", MODEL,
                                "--pool", f"pool-{site}", log=ws / "logs" / f"sim-{site}.log"))
        for name in ("op-a", "op-b", "gw-a", "gw-b"):
            procs.append(_gridd("run", "--config", str(configs[name]), log=ws / "logs" / f"{name}.log"))
        deadline = time.monotonic() + 30
        for site in ("a", "b"):
            _wait_ready(f"http://127.0.0.1:{ports[f'gw-{site}']}/readyz", deadline)
        time.sleep(3)  # let each site see the other through the peer poll
        gw = f"http://127.0.0.1:{ports['gw-a']}"
        print(f"gridd demo: workspace {ws} (configs, certs, logs/)")
        print(f"  gateway a: {gw}/v1   gateway b: http://127.0.0.1:{ports['gw-b']}/v1")
        print(f"  operator metrics: http://127.0.0.1:{ports['met-op-a']}/metrics "
              "(both sites' grid_provider_*)")
        print(f"  gridctl --socket {ws}/run/operator-a.sock status")
        print(f"  curl {gw}/v1/chat/completions -H 'content-type: application/json' "
              f"-d '{{\"model\": \"{MODEL}\", \"messages\": [{{\"role\": \"user\", \"content\": \"hi\"}}]}}'")
        for outcome, count in sorted(_burst(gw, args.requests).items()):
            print(f"  burst through gateway a: {count:3d} x {outcome}")
        sys.stdout.flush()
        end = None if args.duration is None else time.monotonic() + args.duration
        while end is None or time.monotonic() < end:
            if any(p.poll() is not None for p in procs):
                print("gridd demo: a process exited; see logs/", file=sys.stderr)
                return 1
            time.sleep(0.5)
        return 0
    except KeyboardInterrupt:
        return 0
    except TimeoutError as exc:
        print(f"gridd demo: {exc}; see {ws}/logs/", file=sys.stderr)
        return 1
    finally:
        stop_processes(procs, grace_s=15)
