"""Benchmark: gridd's exposition parser against prometheus_client's, on a ~1 MiB EPP body.

Run from the repo root: .venv/bin/python benchmarks/parse.py

The body is generated (seeded; no files needed) in the shape of an llm-d Router v0.10 EPP
leader scrape like tests/data/samples/epp-healthy.prom, with a bigger pool: the
same family set (HELP/TYPE lines, Go runtime and process gauges, the deprecated inference_*
twins, pool gauges, per-endpoint queues, flow control, in-flight load from two producers,
request counters and the duration / TTFT / NTPOT / streaming TPOT / ITL histograms per
model x flow with the fact sheet's buckets), in client_golang's text form. Like that
sample it leaves out the size/token histograms, controller-runtime and workqueue
families a full EPP scrape also carries; those are all unwanted by gridd, so a full
scrape would make the ratio larger, not smaller.

Both parsers run on the same body in the same rounds (interleaved, so machine noise hits
both alike): prometheus_client on the str, fully consuming every family; gridd on the
bytes a scrape hands it (decoding included), with gridd's WANTED set and with None.
gridd with WANTED as a list is the line loop without the scan (gridd.core.exposition._scan),
the same-run baseline for it. Times are medians. The last line is
`ratio=<prometheus_client / gridd with WANTED>`.

Then the rows of the whole per-body path of a scrape as the operator runs it
(gridd.core.publication: parse with WANTED_SAMPLES, kind_mismatch, derive, the latency
window, the readiness verdict) on epp-healthy.prom (75 KB) and vllm-direct.prom, their
counters moving on every scrape (the latency window differences real deltas), in CPU
microseconds per body (process time over a batch, median of batches, then of rounds).
`--src DIR` adds the same rows for another checkout's gridd (e.g. /work/main: the code
before) in the same run: each round starts one worker process per tree, alternating, and
prints `per_body_ratio=<DIR / this tree>` for the EPP body. `--per-body` runs those rows
alone. `--line-bound` measures what the exceptions to the line bound (MAX_EXPOSITION_LINES: a
body read through its provider's shape is not counted first) cost against the bound's own case,
and ends with `line_bound_worst_ratio=`.
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

# A --per-body worker imports gridd from the tree it is given (--tree DIR), before anything.
_TREE = sys.argv[sys.argv.index("--tree") + 1] if "--tree" in sys.argv[:-1] else None
sys.path.insert(0, _TREE or str(Path(__file__).resolve().parent.parent))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from gridd.core.derivation import WANTED_SAMPLES  # noqa: E402
from gridd.core.exposition import parse_exposition  # noqa: E402

ROUNDS = 7  # prometheus_client runs once per round
GRIDD_CALLS_PER_ROUND = 5
TARGET_BYTES = 1 << 20

# Exactly the set the operator's scraper passes to the parser.
WANTED = WANTED_SAMPLES

POOL = "llama3-8b-pool"
NAMESPACE = "llm-d-inference"
MODELS = ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B-Instruct-lora-support")
PRODUCERS = ("inflight-load", "inflight-load-with-output")
ERROR_CODES = ("BadRequest", "ModelServerError")
# Bucket bounds from docs/epp-metrics.md section 5.
TTFT = (
    0.005,
    0.025,
    0.05,
    0.1,
    0.2,
    0.4,
    0.6,
    0.8,
    1,
    1.25,
    1.5,
    2,
    3,
    4,
    5,
    6,
    8,
    10,
    15,
    20,
    30,
    45,
    60,
    120,
)
DURATION = TTFT + (180, 240, 300, 360, 480, 600, 900, 1200, 1800, 2700, 3600)
NTPOT = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10)
TPOT = (
    0.0005,
    0.00205,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.125,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.6,
    0.8,
    1,
    2,
)
ITL = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2)

Row = tuple[str, dict[str, str], str]  # sample name, labels (in print order), value text


def go_float(x: float) -> str:
    """A number the way client_golang prints it: 1, 0.005, 1.048576e+06."""
    if x == int(x) and abs(x) < 1e6:
        return str(int(x))
    return repr(x) if 1e-4 <= abs(x) < 1e6 else f"{x:.6e}".replace("0000e", "e")


def render(name: str, labels: dict[str, str], value: str) -> str:
    if not labels:
        return f"{name} {value}"
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return f"{name}{{{inner}}} {value}"


def build_body(endpoints: int, flows: int, seed: int = 7) -> str:
    """An EPP scrape of one pool with `endpoints` endpoints and `flows` fairness flows."""
    rng = random.Random(seed)
    pods = [f"llama3-8b-decode-7d9c8f6b5-{rng.randrange(36**5):05x}" for _ in range(endpoints)]
    flow_ids = [("default-flow", "0")] + [(f"team-{i}", str(1 + i % 3)) for i in range(1, flows)]
    per_flow = [
        {"fairness_id": f, "model_name": m, "priority": p, "target_model_name": m}
        for m in MODELS
        for f, p in flow_ids
    ]
    families: dict[str, tuple[str, list[Row]]] = {}

    def gauge(name: str, rows: list[tuple[dict[str, str], str]], kind: str = "gauge") -> None:
        families[name] = (kind, [(name, labels, value) for labels, value in rows])

    def histogram(name: str, bounds: tuple[float, ...], streaming: bool = False) -> None:
        rows: list[Row] = []
        for common in per_flow:
            for split in ({"streaming": "false"}, {"streaming": "true"}) if streaming else ({},):
                labels = dict(sorted({**common, **split}.items()))
                total = rng.randrange(50, 5000)
                seen = 0
                for bound in (*map(go_float, bounds), "+Inf"):
                    seen = total if bound == "+Inf" else min(total, seen + rng.randrange(max(1, total // 6)))
                    rows.append((f"{name}_bucket", {**labels, "le": bound}, str(seen)))
                rows.append((f"{name}_sum", labels, go_float(round(total * rng.uniform(0.01, 3), 6))))
                rows.append((f"{name}_count", labels, str(total)))
        families[name] = ("histogram", rows)

    def pool(**extra: str) -> dict[str, str]:
        return dict(sorted({"name": POOL, **extra}.items()))

    def flow_pool(common: dict[str, str]) -> dict[str, str]:
        return dict(sorted({**common, "inference_pool": POOL}.items()))

    gc_quantiles = [
        ({"quantile": q}, go_float(rng.uniform(1e-5, 1e-3))) for q in ("0", "0.25", "0.5", "0.75", "1")
    ]
    families["go_gc_duration_seconds"] = (
        "summary",
        [("go_gc_duration_seconds", labels, value) for labels, value in gc_quantiles]
        + [("go_gc_duration_seconds_sum", {}, "0.913541"), ("go_gc_duration_seconds_count", {}, "4012")],
    )
    gauge("go_goroutines", [({}, "412")])
    for stat in (
        "alloc",
        "heap_alloc",
        "heap_idle",
        "heap_inuse",
        "heap_released",
        "heap_sys",
        "stack_inuse",
        "sys",
    ):
        gauge(f"go_memstats_{stat}_bytes", [({}, go_float(rng.randrange(1 << 20, 1 << 30)))])
    gauge("process_resident_memory_bytes", [({}, "1.87392e+08")])
    gauge("process_start_time_seconds", [({}, "1.78730011842e+09")])

    for prefix in ("inference_extension_", "llm_d_epp_"):
        gauge(f"{prefix}info", [({"build_ref": "v0.10.0", "commit": "ebab6879"}, "1")])
        gauge(f"{prefix}flow_control_queue_size", [(flow_pool(c), str(rng.randrange(3))) for c in per_flow])
    pod_label = {"inference_extension_": "pod_name", "llm_d_epp_": "endpoint_name"}
    for prefix, endpoint_label in pod_label.items():
        rows = [
            (
                dict(
                    sorted(
                        {
                            endpoint_label: pod,
                            "namespace": NAMESPACE,
                            "port": "8000",
                            "status": "success",
                            "target_model_name": m,
                        }.items()
                    )
                ),
                str(rng.randrange(10000)),
            )
            for pod in pods
            for m in MODELS
        ]
        gauge(f"{prefix}scheduler_attempts_total", rows, "counter")
    gauge(
        "llm_d_epp_flow_control_queue_bytes", [(flow_pool(c), str(rng.randrange(1 << 16))) for c in per_flow]
    )
    gauge(
        "llm_d_epp_flow_control_pool_saturation",
        [({"inference_pool": POOL, "stage": stage}, "0.5375") for stage in ("decode", "effective")],
    )
    gauge(
        "llm_d_epp_flow_control_requests_total",
        [
            ({"inference_pool": POOL, "outcome": outcome, "priority": p}, str(rng.randrange(100000)))
            for outcome in ("Dispatched", "EvictedTTL", "RejectedCapacity")
            for p in ("0", "1", "2", "3")
        ],
        "counter",
    )

    for prefix, ready, per_endpoint, endpoint_label in (
        ("inference_pool_", "ready_pods", "per_pod_queue_size", "model_server_pod"),
        ("llm_d_epp_", "ready_endpoints", "per_endpoint_queue_size", "model_server_endpoint"),
    ):
        gauge(f"{prefix}{ready}", [(pool(), str(endpoints))])
        for stat, value in (
            ("kv_cache_utilization", "0.43"),
            ("queue_size", "1"),
            ("running_requests", "11.5"),
        ):
            gauge(f"{prefix}average_{stat}", [(pool(), value)])
        gauge(
            f"{prefix}{per_endpoint}",
            [(pool(**{endpoint_label: f"{pod}-rank-0"}), str(rng.randrange(5))) for pod in pods],
        )
    for stat, value in (
        ("kv_cache_utilization", "0.07"),
        ("queue_size", "0.82"),
        ("running_requests", "2.08"),
    ):
        gauge(f"llm_d_epp_std_dev_{stat}", [(pool(), value)])

    for stat, scale in (("requests", 20), ("tokens", 9000)):
        rows = [
            (
                {
                    "endpoint_name": f"{pod}-rank-0",
                    "fairness_id": f,
                    "namespace": NAMESPACE,
                    "priority": p,
                    "producer_name": producer,
                },
                str(rng.randrange(scale)),
            )
            for pod in pods
            for f, p in flow_ids
            for producer in PRODUCERS
        ]
        gauge(f"llm_d_epp_inflight_{stat}", rows)

    legacy = [{"model_name": m, "target_model_name": m} for m in MODELS]
    gauge(
        "inference_objective_request_total",
        [({**c, "priority": p}, str(rng.randrange(10**5))) for c in legacy for p in "0123"],
        "counter",
    )
    gauge(
        "inference_objective_request_error_total",
        [({"error_code": e, **c}, str(rng.randrange(100))) for c in legacy for e in ERROR_CODES],
        "counter",
    )
    gauge(
        "inference_objective_running_requests", [({"model_name": m}, str(rng.randrange(100))) for m in MODELS]
    )
    gauge("llm_d_epp_request_total", [(c, str(rng.randrange(10**5))) for c in per_flow], "counter")
    gauge(
        "llm_d_epp_request_error_total",
        [({"error_code": e, **c}, str(rng.randrange(100))) for c in per_flow for e in ERROR_CODES],
        "counter",
    )
    gauge("llm_d_epp_request_running", [(c, str(rng.randrange(50))) for c in per_flow])
    histogram("llm_d_epp_request_duration_seconds", DURATION)
    histogram("llm_d_epp_request_ntpot_seconds", NTPOT)
    histogram("llm_d_epp_request_streaming_itl_seconds", ITL)
    histogram("llm_d_epp_request_streaming_tpot_seconds", TPOT)
    histogram("llm_d_epp_request_ttft_seconds", TTFT, streaming=True)

    out: list[str] = []
    for name in sorted(families):
        kind, rows = families[name]
        deprecated = "[Deprecated: Use llm_d_epp_...] " if name.startswith("inference_") else ""
        out.append(f"# HELP {name} [ALPHA] {deprecated}{name.replace('_', ' ')}.")
        out.append(f"# TYPE {name} {kind}")
        out.extend(render(*row) for row in rows)
    return "\n".join(out) + "\n"


def realistic_body() -> str:
    """The smallest generated pool (5 endpoints per flow) whose body reaches TARGET_BYTES."""
    for flows in range(2, 64):
        body = build_body(endpoints=5 * flows, flows=flows)
        if len(body.encode()) >= TARGET_BYTES:
            return body
    raise RuntimeError("the generator never reached the target size")


def consume_prometheus_client(text: str) -> int:
    return sum(len(family.samples) for family in text_string_to_metric_families(text))


def main(src: str | None, rounds: int) -> None:
    text = realistic_body()
    raw = text.encode()
    sample_lines = [line for line in text.split("\n") if line and not line.startswith("#")]
    kept_lines = sum(1 for line in sample_lines if line.split("{", 1)[0].split(" ", 1)[0] in WANTED)

    # Both parsers must agree on the body before their times mean anything.
    everything = parse_exposition(raw)
    kept = parse_exposition(raw, WANTED)
    counts = (
        everything.malformed_lines,
        sum(map(len, everything.samples.values())),
        consume_prometheus_client(text),
        sum(map(len, kept.samples.values())),
    )
    if counts != (0, len(sample_lines), len(sample_lines), kept_lines):
        raise SystemExit(f"parsers disagree on the body: {counts}")

    wanted_list = sorted(WANTED)
    # The 75 KB reference scrape the scale benchmark serves: a quarter of its lines wanted.
    healthy = (Path(__file__).resolve().parent.parent / "tests/data/samples/epp-healthy.prom").read_bytes()
    runs: dict[str, Callable[[], object]] = {
        "prometheus_client text_string_to_metric_families": lambda: consume_prometheus_client(text),
        "gridd parse_exposition(bytes, WANTED)": lambda: parse_exposition(raw, WANTED),
        # The same names as a list: no scan, the line loop visits every line (the parse before
        # the scan, kept as the same-run baseline).
        "gridd parse_exposition(bytes, list(WANTED)), line loop": lambda: parse_exposition(raw, wanted_list),
        "epp-healthy.prom (75 KB): gridd (bytes, WANTED)": lambda: parse_exposition(healthy, WANTED),
        "epp-healthy.prom (75 KB): gridd (bytes, list(WANTED)), line loop": lambda: parse_exposition(
            healthy, wanted_list
        ),
        "gridd parse_exposition(str, WANTED)": lambda: parse_exposition(text, WANTED),
        "gridd parse_exposition(bytes, None)": lambda: parse_exposition(raw),
    }
    times: dict[str, list[float]] = {label: [] for label in runs}
    for _ in range(ROUNDS):
        for label, run in runs.items():
            for _ in range(1 if label.startswith("prometheus_client") else GRIDD_CALLS_PER_ROUND):
                start = time.perf_counter()
                run()
                times[label].append(time.perf_counter() - start)
    ms = {label: statistics.median(samples) * 1000 for label, samples in times.items()}
    reference = ms["prometheus_client text_string_to_metric_families"]

    print(
        f"body: {len(raw)} bytes, {text.count(chr(10))} lines, {len(sample_lines)} samples, "
        f"{kept_lines} ({kept_lines / len(sample_lines):.0%}) in WANTED ({len(WANTED)} names)"
    )
    print(f"{'parser':<68}{'median ms':>10}{'speed-up':>10}")
    for label, value in ms.items():
        # The 75 KB rows are another body: no speed-up against the 1 MiB reference.
        speedup = "-" if label.startswith("epp-healthy") else f"{reference / value:.1f}x"
        print(f"{label:<68}{value:>10.2f}{speedup:>10}")
    scan_vs_loop = (
        ms["gridd parse_exposition(bytes, WANTED)"]
        / ms["gridd parse_exposition(bytes, list(WANTED)), line loop"]
    )
    small_scan_vs_loop = (
        ms["epp-healthy.prom (75 KB): gridd (bytes, WANTED)"]
        / ms["epp-healthy.prom (75 KB): gridd (bytes, list(WANTED)), line loop"]
    )
    print(f"scan vs line loop, same run: {scan_vs_loop:.2f} (1 MiB body), {small_scan_vs_loop:.2f} (75 KB)")
    per_body(src, rounds)
    print(f"ratio={reference / ms['gridd parse_exposition(bytes, WANTED)']:.1f}")


SAMPLES = Path(__file__).resolve().parent.parent / "tests/data/samples"
# (sample, metrics.kind, the provider's model): the two bodies a provider serves.
PER_BODY = (("epp-healthy.prom", "epp", "meta-llama/Llama-3.1-8B-Instruct"),
            ("vllm-direct.prom", "vllm", "meta-llama/Llama-3.1-8B-Instruct"))
PER_BODY_SCRAPES = 64  # distinct bodies per sample, scraped in turn
PER_BODY_BATCH = 200  # bodies per timed batch
PER_BODY_BATCHES = 9
# A counter sample's value: *_total, *_count, *_sum and the +Inf bucket move every scrape.
_COUNTER_VALUE = re.compile(
    rb'^((?:[^#\n][^ \n]*(?:_total|_count|_sum)|[^#\n][^\n]*le="\+Inf")[^\n]*? )([0-9.e+]+)$', re.M
)


def moving_bodies(body: bytes, scrapes: int) -> list[bytes]:
    """The body as ``scrapes`` successive scrapes see it: each counter one request (a sum
    50 ms) further on each scrape, so the latency window reads real deltas."""
    def render(scrape: int) -> bytes:
        def bump(match: re.Match[bytes]) -> bytes:
            step = 0.05 if match.group(1).split(b"{")[0].rstrip().endswith(b"_sum") else 1.0
            return match.group(1) + b"%.10g" % (float(match.group(2)) + step * scrape)
        return _COUNTER_VALUE.sub(bump, body)
    return [render(scrape) for scrape in range(scrapes)]


def per_body_worker() -> None:
    """One tree's per-body CPU microseconds, one line per sample: `name us`."""
    import gridd

    if _TREE is not None and not Path(gridd.__file__).resolve().is_relative_to(Path(_TREE).resolve()):
        raise SystemExit(f"gridd imported from {gridd.__file__}, not from {_TREE}")
    for filename, kind, model in PER_BODY:
        print(filename, f"{per_body_us(filename, kind, model):.1f}")
    for filename, kind, model in PER_BODY:
        print(f"{filename}:on_scrape", f"{on_scrape_us(filename, kind, model):.1f}")


def per_body_us(filename: str, kind: str, model: str) -> float:
    """CPU microseconds per body of the scrape path on one sample, median of the batches."""
    from gridd.core.derivation import derive, kind_mismatch
    from gridd.core.latency import LatencyWindow
    from gridd.core.readiness import ReadinessTracker

    bodies = moving_bodies((SAMPLES / filename).read_bytes(), PER_BODY_SCRAPES)
    window = LatencyWindow(kind=kind, models=frozenset({model}))
    readiness = ReadinessTracker(created_at=0.0)
    try:  # the provider's series cache, where the tree has one (the operator keeps one per provider)
        from gridd.core.exposition import SeriesCache
    except ImportError:
        cache: tuple[object, ...] = ()
    else:
        cache = (SeriesCache(),)

    def step(body: bytes, now: float) -> None:
        # gridd.core.publication.ProviderPublisher.on_scrape, its per-body part.
        expo = parse_exposition(body, WANTED, *cache)
        if kind_mismatch(expo, kind) is None and not (expo.malformed_lines and not expo.samples):
            load = derive(expo, kind=kind).load
            window.observe(now, expo)
            readiness.on_scrape(now, ready_endpoints=load.ready_endpoints,
                                engine_answered=window.answered_on_last_observe)
        readiness.verdict(now, stale_after_s=10.0, unavailable=False)

    return cpu_us_per_body(bodies, step)


def cpu_us_per_body(bodies: list[bytes], step: Callable[[bytes, float], None]) -> float:
    """CPU microseconds per ``step(body, now)`` over the bodies in turn (one a second), median
    of the batches after a warm-up batch."""
    now = 0.0
    batches = []
    for batch in range(PER_BODY_BATCHES + 1):
        start = time.process_time()
        for i in range(PER_BODY_BATCH):
            now += 1.0
            step(bodies[i % PER_BODY_SCRAPES], now)
        if batch:  # the first batch warms up
            batches.append((time.process_time() - start) / PER_BODY_BATCH * 1e6)
    return statistics.median(batches)


def on_scrape_us(filename: str, kind: str, model: str) -> float:
    """CPU microseconds per body of ProviderPublisher.on_scrape (the rows above plus its own
    work: the line-count guard, the batch, its validation), median of the batches."""
    from gridd.core.publication import ProviderPublisher

    bodies = moving_bodies((SAMPLES / filename).read_bytes(), PER_BODY_SCRAPES)
    sequence = iter(range(1, 1 << 40)).__next__
    publisher = ProviderPublisher(site="s", provider="p", model=model, provider_uid="u", generation=1,
                                  publisher_epoch=1, created_at=0.0, next_sequence=sequence, kind=kind)

    def step(body: bytes, now: float) -> None:
        publisher.on_scrape(now=now, wall_now=now, body=body, failure_class=None, stale_after_s=10.0,
                            unavailable=False)

    return cpu_us_per_body(bodies, step)


def per_body(src: str | None, rounds: int) -> None:
    here = str(Path(__file__).resolve().parent.parent)
    trees = {"this tree": here} | ({src: src} if src else {})
    results: dict[str, dict[str, list[float]]] = {tree: {} for tree in trees}
    for _ in range(rounds):
        for tree, path in trees.items():
            out = subprocess.run(
                [sys.executable, __file__, "--per-body-worker", "--tree", path],
                check=True, capture_output=True, text=True,
            ).stdout
            for line in out.splitlines():
                name, us = line.split()
                results[tree].setdefault(name, []).append(float(us))
    print(f"per-body path CPU us per body, median of {rounds} rounds "
          f"(parse + kind_mismatch + derive + latency window + readiness; "
          f"<sample>:on_scrape = ProviderPublisher.on_scrape, the same plus its own work):")
    for tree, by_sample in results.items():
        for name, values in by_sample.items():
            print(f"  {tree:<24}{name:<30}{statistics.median(values):>9.1f}   "
                  f"[{min(values):.1f}..{max(values):.1f}]")
    if src:
        ratio = statistics.median(results[src]["epp-healthy.prom"]) / statistics.median(
            results["this tree"]["epp-healthy.prom"])
        print(f"per_body_ratio={ratio:.2f}")
        before, after = (statistics.median(results[tree]["epp-healthy.prom:on_scrape"])
                         for tree in (src, "this tree"))
        saved = before - after
        print(f"on_scrape_us_saved={saved:.1f}")


def line_bound(rounds: int) -> None:
    """What MAX_EXPOSITION_LINES's exceptions cost (tests/test_scrape_path_oracle.py checks the
    paths): a 1 MiB body read through the provider's shape, padded with lines the scan leaves
    out (accepted) or picks (refused right after the scan), against the bound's own case (a
    first scrape of MAX_EXPOSITION_LINES junk lines the scan picks, each one malformed)."""
    import time

    from gridd.core.publication import MAX_EXPOSITION_LINES, ProviderPublisher

    good = (Path(__file__).resolve().parent.parent / "tests/data/samples/epp-healthy.prom").read_bytes()

    def publisher(shaped: bool) -> ProviderPublisher:
        pub = ProviderPublisher(site="a", provider="p", model="m", provider_uid="u", generation=1,
                                publisher_epoch=7, created_at=0.0, next_sequence=iter(range(1, 99)).__next__)
        for now in (1.0, 2.0) if shaped else ():
            pub.on_scrape(now=now, wall_now=1000.0 + now, body=good, failure_class=None, stale_after_s=10,
                          unavailable=False)
        return pub

    def cpu_s(body: bytes, shaped: bool) -> float:
        pub = publisher(shaped)
        start = time.process_time()
        pub.on_scrape(now=3.0, wall_now=1003.0, body=body, failure_class=None, stale_after_s=10,
                      unavailable=False)
        return time.process_time() - start

    cases = {"the bound: 50 000 junk lines, no shape": (b"9\n" * MAX_EXPOSITION_LINES, False)}
    for pad in (b"\n", b"a\n", b" \n", b"9\n"):
        cases[f"shape + 1 MiB of {pad!r}"] = (good + pad * ((1 << 20) // len(pad)), True)
    costs: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):  # interleaved, so the machine's noise hits every case alike
        for name, (body, shaped) in cases.items():
            costs[name].append(cpu_s(body, shaped))
    bound = statistics.median(costs[next(iter(cases))])
    print(f"line bound: CPU ms per scrape, median of {rounds} (ratio to the bound's case)")
    for name, values in costs.items():
        median = statistics.median(values)
        print(f"  {name:<42}{median * 1e3:>8.1f} ms   {median / bound:>5.2f}")
    worst = max(statistics.median(values) for values in costs.values()) / bound
    print(f"line_bound_worst_ratio={worst:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--line-bound", action="store_true",
                        help="what the line bound's exceptions cost against the bound's own case")
    parser.add_argument("--per-body", action="store_true", help="the per-body path rows alone")
    parser.add_argument("--src", help="another checkout to compare the per-body path with (e.g. /work/main)")
    parser.add_argument("--rounds", type=int, default=5, help="per-body rounds (one worker per tree each)")
    parser.add_argument("--per-body-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tree", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.per_body_worker:
        per_body_worker()
    elif args.line_bound:
        line_bound(args.rounds)
    elif args.per_body:
        per_body(args.src, args.rounds)
    else:
        main(args.src, args.rounds)
