"""``gridd sim``: serve one simulated EPP pool or vLLM server until SIGINT/SIGTERM.

Log lines go to stderr with a syslog priority prefix (``<6>`` info, ``<3>`` error), as
systemd's journal reads them.
"""

from __future__ import annotations

import argparse
import signal
import sys

import trio

from gridd.http.serve import serve_asgi
from gridd.sim.app import SimApp
from gridd.sim.model import SimKnobs, knobs_from

_DEFAULTS = SimKnobs()


def _log(priority: int, message: str) -> None:
    print(f"<{priority}>{message}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gridd sim",
        description="Simulated LLM serving backend (EPP or vLLM /metrics, OpenAI-compatible completions).",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8088, help="port to bind; 0 picks a free one (default 8088)")
    d = _DEFAULTS
    p.add_argument("--endpoints", type=int, default=d.endpoints, help="serving endpoints (engines)")
    p.add_argument("--max-seqs", type=int, default=d.max_seqs, help="concurrent sequences per endpoint")
    p.add_argument("--ttft-s", type=float, default=d.ttft_s, help="seconds from start to first token")
    p.add_argument("--tpot-s", type=float, default=d.tpot_s, help="seconds per further output token")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens,
                   help="output tokens when a request sets no max_tokens")
    p.add_argument("--flavour", choices=("epp", "vllm"), default=d.flavour, help="/metrics flavour")
    p.add_argument("--pool", default=d.pool, help="InferencePool name (EPP name= label)")
    p.add_argument("--model", default=d.model, help="served model name")
    p.add_argument("--zero-ready", action=argparse.BooleanOptionalAction, default=d.zero_ready,
                   help="report 0 ready endpoints (stale averages) while serving")
    p.add_argument("--stop-unit-series", action=argparse.BooleanOptionalAction, default=d.stop_unit_series,
                   help="drop per-endpoint series while the ready count keeps coming")
    p.add_argument("--huge-body", action=argparse.BooleanOptionalAction, default=d.huge_body,
                   help="pad /metrics past 1 MiB with padding series")
    p.add_argument("--body-bytes", type=int, default=d.body_bytes,
                   help="pad /metrics with comment lines to exactly this many bytes (0: off)")
    p.add_argument("--metrics-hang", action=argparse.BooleanOptionalAction, default=d.metrics_hang,
                   help="never answer /metrics")
    p.add_argument("--metrics-delay-s", type=float, default=d.metrics_delay_s, help="delay /metrics answers")
    p.add_argument("--status-5xx", type=int, default=d.status_5xx,
                   help="answer every inference request with this 5xx status (0: off)")
    p.add_argument("--error-ratio", type=float, default=d.error_ratio,
                   help="fraction of inference requests failing with 500")
    p.add_argument("--flow-control", action=argparse.BooleanOptionalAction, default=d.flow_control,
                   help="hold requests in the EPP flow-control queue instead of endpoint queues")
    p.add_argument("--queue-limit", type=int, default=d.queue_limit,
                   help="waiting requests per endpoint before 429 (0: unlimited)")
    return p


def _knob_args(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in SimKnobs.__struct_fields__}


def _bind_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def serve(host: str, port: int, knobs: SimKnobs) -> None:
    """Serve until SIGINT or SIGTERM."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            app = SimApp(knobs)
            urls = await nursery.start(serve_asgi, app, [_bind_address(host, port)])
            _log(6, f"gridd sim listening on {urls[0]} flavour={knobs.flavour} endpoints={knobs.endpoints} "
                    f"max_seqs={knobs.max_seqs} model={knobs.model}")
            async for signum in signals:
                _log(6, f"gridd sim stopping on {signal.Signals(signum).name}")
                nursery.cancel_scope.cancel()
                break


def _first(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    if isinstance(exc, kind):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _first(inner, kind)
            if found is not None:
                return found
    return None


def main(argv: list[str]) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed usage or help
        return int(exc.code or 0)
    try:
        knobs = knobs_from(_knob_args(args))
    except ValueError as exc:
        _log(3, f"gridd sim: invalid setting: {exc}")
        return 2
    if not 0 <= args.port <= 65535:
        _log(3, f"gridd sim: invalid setting: --port {args.port} is not in 0..65535")
        return 2
    try:
        trio.run(serve, args.host, args.port, knobs)
    except KeyboardInterrupt:
        return 0
    except (OSError, BaseExceptionGroup) as exc:
        err = _first(exc, OSError)
        if err is None:
            raise
        _log(3, f"gridd sim: cannot listen on {_bind_address(args.host, args.port)}: {err}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
