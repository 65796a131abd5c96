"""Routing simulator: gridd's real routing core against the routers an operator could pick.

    python benchmarks/routing/run.py --scenario steady      # ends with vs_static=...
    python benchmarks/routing/run.py --scenario herd        # ends with ratio=...
    python benchmarks/routing/run.py --scenario all --plots docs/img

Every policy of a cell sees the same arrivals (times, sizes, gateways) and the same signal
delays; each cell runs ``--seeds`` seeds and pools their requests. Scenarios and the site
model are described in docs/routing.md ("Measured in the routing simulator") and in
benchmarks/routing/sim.py. Pure Python, no network, bounded: every run simulates a fixed
number of seconds.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass, replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sim import Cell, Event, GriddKnobs, Result, SiteSpec, percentile, simulate  # noqa: E402

from gridd.core.strategy import Strategy, StrategyTable  # noqa: E402

TWO_TO_ONE = (SiteSpec("a", 4), SiteSpec("b", 2))
EIGHT_FOUR_ONE = (SiteSpec("a", 8), SiteSpec("b", 4), SiteSpec("c", 1))
BASELINES = ("static", "wrr", "greedy", "least_busy", "random")
GRIDD = {
    "gridd": GriddKnobs({"shedding": True}),
    # The spec's selection rules read literally, no pending sends: what the decisions beat.
    "gridd-spec": GriddKnobs({"shedding": True, "pick_rule": "spec_tiers", "pending_weight": 0.0}),
    # No baseline sheds: this is gridd's routing alone, queueing everything it is sent.
    "gridd-noshed": GriddKnobs({"shedding": False}),
    # The default pick without the gateway's own pending sends.
    "gridd-nopending": GriddKnobs({"shedding": True, "pending_weight": 0.0}),
}

# Spec 004's strategy.yaml, verbatim: drop a site over 5 waiting or 90% KV, lowest queue first.
PERFORMANCE_BASED = Strategy.of("performance_based",
                                {"performance": {"num_requests_waiting": 5, "kv_cache_usage_perc": 0.9}},
                                [("performance.num_requests_waiting", False)])
PROBE_GRIDD = {
    "gridd-strategy": GriddKnobs({"shedding": True, "strategies": StrategyTable(PERFORMANCE_BASED)}),
    "gridd-strict": GriddKnobs({"shedding": True,
                                "strategies": StrategyTable(PERFORMANCE_BASED, pick_rule="strict")}),
}
"""Only in the probe scenario (the other scenarios' tables stay as they were)."""
GRIDD_VARIANTS = {**GRIDD, **PROBE_GRIDD}


@dataclass(frozen=True)
class Job:
    label: str
    cell: Cell
    policy: str


@dataclass
class Pooled:
    """One (cell label, policy) over every seed."""

    label: str
    policy: str
    waits: list[float]
    ttfts: list[float]
    served: dict[str, int]
    capacity_share: dict[str, float]
    completed: int = 0
    measured_s: float = 0.0
    shed: int = 0
    unavailable: int = 0
    not_found: int = 0

    def add(self, r: Result) -> None:
        self.waits += r.waits
        self.ttfts += r.ttfts
        for site, n in r.served_by_site.items():
            self.served[site] = self.served.get(site, 0) + n
        self.completed += r.completed
        self.measured_s += r.measured_s
        self.shed += r.shed
        self.unavailable += r.unavailable
        self.not_found += r.not_found

    @property
    def p99(self) -> float:
        return percentile(self.waits, 0.99)

    def share(self, site: str) -> float:
        total = sum(self.served.values())
        return self.served.get(site, 0) / total if total else 0.0


def _run(job: Job) -> tuple[str, str, Result]:
    return job.label, job.policy, simulate(job.cell, "gridd" if job.policy in GRIDD_VARIANTS else job.policy,
                                           GRIDD_VARIANTS.get(job.policy))


def _jobs(cells: list[tuple[str, Cell]], seeds: int, policies: tuple[str, ...]) -> list[Job]:
    return [Job(label, replace(cell, seed=seed), policy)
            for label, cell in cells for seed in range(1, seeds + 1) for policy in policies]


def scenario_cells(name: str, duration_s: float) -> list[tuple[str, Cell]]:
    d = duration_s
    if name == "steady":
        return [(f"{topo} {int(load * 100)}%", Cell(sites=sites, load=load, duration_s=d))
                for topo, sites in (("2:1", TWO_TO_ONE), ("8:4:1", EIGHT_FOUR_ONE))
                for load in (0.3, 0.5, 0.7, 0.9)]
    if name == "herd":
        return [("8:4:1 70% 4 gw/site +2 s", Cell(sites=EIGHT_FOUR_ONE, load=0.7, duration_s=d,
                                                   gateways_per_site=4, extra_delay_s=2.0))]
    if name == "burst":
        return [("8:4:1 40%, x3 for 10 s", Cell(sites=EIGHT_FOUR_ONE, load=0.4, duration_s=d,
                                                bursts=((d / 2, d / 2 + 10.0, 3.0),)))]
    if name == "scale":
        return [("2:1 60%, b 2->4->2 units", Cell(sites=TWO_TO_ONE, load=0.6, duration_s=d, events=(
            Event(d / 3, "units", "b", 4), Event(2 * d / 3, "units", "b", 2))))]
    if name == "slow":
        return [("8:4:1 50%, a x3 slower", Cell(sites=EIGHT_FOUR_ONE, load=0.5, duration_s=d, events=(
            Event(d / 3, "speed", "a", 3.0),)))]
    if name == "silent":
        return [("8:4:1 50%, b's operator silent", Cell(sites=EIGHT_FOUR_ONE, load=0.5, duration_s=d, events=(
            Event(d / 3, "silent", "b", 1.0),)))]
    if name == "cold":
        return [("8:4:1 70%, gateways restart", Cell(sites=EIGHT_FOUR_ONE, load=0.7, duration_s=d, events=(
            Event(d / 2, "restart_gateways"),)))]
    if name == "probe":
        # Probes publish every 5 s (spec 004 Example 1); batches carry them every 1 s scrape.
        return [(f"{topo} {int(load * 100)}%, probes 5 s",
                 Cell(sites=sites, load=load, duration_s=d, probe_s=5.0))
                for topo, sites in (("2:1", TWO_TO_ONE), ("8:4:1", EIGHT_FOUR_ONE)) for load in (0.5, 0.7)]
    raise SystemExit(f"unknown scenario {name!r}")


SCENARIOS = ("steady", "herd", "burst", "scale", "slow", "silent", "cold", "probe")
SCENARIO_SEEDS = {"probe": 6}
"""Seeds per cell where 3 do not separate the policies: at 70% load the two pick rules under a
strategy differ by less than the seed-to-seed spread of 3 seeds (measured: 8.21 vs 7.91 s and
20.65 vs 19.17 s at 3 seeds, and either order with small changes to the grid's tie-break)."""


def run_scenario(name: str, *, seeds: int, duration_s: float,
                 processes: int) -> dict[tuple[str, str], Pooled]:
    cells = scenario_cells(name, duration_s)
    policies = (*GRIDD, *(PROBE_GRIDD if name == "probe" else ()), *BASELINES)
    jobs = _jobs(cells, seeds, policies)
    pooled: dict[tuple[str, str], Pooled] = {}
    cell_of = dict(cells)
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        for label, policy, result in pool.imap_unordered(_run, jobs, chunksize=1):
            key = (label, policy)
            if key not in pooled:
                pooled[key] = Pooled(label, policy, [], [], {}, result.capacity_share)
            pooled[key].add(result)
    return {(label, p): pooled[(label, p)] for label in cell_of for p in policies}


def _fmt_s(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2f}"


def print_table(name: str, pooled: dict[tuple[str, str], Pooled]) -> None:
    print(f"\n## {name}\n")
    print("| cell | policy | p50 wait s | p99 wait s | p99 TTFT s | queued | req/s | shares (capacity share) "
          "| 429 | 503 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (label, policy), p in pooled.items():
        queued = sum(1 for w in p.waits if w > 1e-9) / len(p.waits) if p.waits else 0.0
        shares = " ".join(f"{s} {p.share(s):.2f} ({c:.2f})" for s, c in sorted(p.capacity_share.items()))
        print(f"| {label} | {policy} | {_fmt_s(percentile(p.waits, 0.5))} | {_fmt_s(p.p99)} | "
              f"{_fmt_s(percentile(p.ttfts, 0.99))} | {queued:.3f} | "
              f"{p.completed / p.measured_s if p.measured_s else 0:.1f} | {shares} | {p.shed} | "
              f"{p.unavailable} |")


def verdict(name: str, pooled: dict[tuple[str, str], Pooled]) -> list[str]:
    """The scenario's closing lines."""
    labels = list(dict.fromkeys(label for label, _ in pooled))
    lines = []
    if name == "steady":
        worst, worst_cell = 0.0, ""
        for label in labels:
            if label.endswith(" 30%"):
                continue
            ratio = pooled[(label, "gridd")].p99 / max(pooled[(label, "static")].p99, 1e-9)
            if ratio > worst:
                worst, worst_cell = ratio, label
        share_gaps = [abs(pooled[(label, "gridd")].share(site) - c)
                      for label in labels if label.endswith(" 50%")
                      for site, c in pooled[(label, "gridd")].capacity_share.items()]
        shed_below_90 = sum(pooled[(label, "gridd")].shed for label in labels if not label.endswith(" 90%"))
        lines.append(f"worst cell: {worst_cell}")
        lines.append(f"share_gap_50=max |share - capacity share| at 50% = {max(share_gaps):.3f}")
        lines.append(f"shed_below_90={shed_below_90}")
        lines.append(f"vs_static={worst:.3f}")
    elif name == "probe":
        for label in labels:
            strict, default = pooled[(label, "gridd-strict")], pooled[(label, "gridd-strategy")]
            lines.append(f"{label}: strict p99 {strict.p99:.2f} s (503 {strict.unavailable}), "
                         f"two_choices p99 {default.p99:.2f} s (503 {default.unavailable}), "
                         f"no strategy p99 {pooled[(label, 'gridd')].p99:.2f} s")
        # The worst cell decides: the default pick rule must not lose anywhere.
        ratios = [max(pooled[(label, "gridd-strict")].p99, 0.1)
                  / max(pooled[(label, "gridd-strategy")].p99, 0.1) for label in labels]
        lines.append(f"probe_ratio={min(ratios):.2f}")
    elif name == "herd":
        label = labels[0]
        ratio = pooled[(label, "greedy")].p99 / max(pooled[(label, "gridd")].p99, 1e-9)
        lines.append(f"ratio={ratio:.2f}")
    else:
        label = labels[0]
        gridd = pooled[(label, "gridd")]
        best = min(BASELINES, key=lambda b: pooled[(label, b)].p99)
        static = pooled[(label, "static")].p99
        lines.append(f"gridd p99 {gridd.p99:.2f} s, 429 {gridd.shed}, 503 {gridd.unavailable}; "
                     f"static p99 {static:.2f} s; best baseline {best} p99 {pooled[(label, best)].p99:.2f} s")
        # p99 waits under 0.1 s are all "hardly anything queued": compared from there up.
        lines.append(f"{name}_vs_static={max(gridd.p99, 0.1) / max(static, 0.1):.3f}")
    return lines


def plot(name: str, pooled: dict[tuple[str, str], Pooled], directory: str) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no plot: matplotlib is not installed; pip install '.[bench]')")
        return None
    os.makedirs(directory, exist_ok=True)
    labels = list(dict.fromkeys(label for label, _ in pooled))
    policies = list(dict.fromkeys(policy for _, policy in pooled))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(labels) + 3), 4))
    width = 0.8 / len(policies)
    for i, policy in enumerate(policies):
        values = [pooled[(label, policy)].p99 for label in labels]
        ax.bar([x + i * width for x in range(len(labels))], values, width, label=policy)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))], labels, rotation=20, fontsize=8)
    ax.set_ylabel("p99 queue wait (s)")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_title(f"routing simulator: {name}")
    ax.legend(fontsize=7, ncols=2)
    fig.tight_layout()
    path = os.path.join(directory, f"routing-{name}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", default="steady", choices=(*SCENARIOS, "all"))
    parser.add_argument("--seeds", type=int, help="seeds per cell, pooled (default 3; 6 for probe)")
    parser.add_argument("--duration", type=float, default=600.0,
                        help="simulated seconds per run (default 600)")
    parser.add_argument("--processes", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--plots", metavar="DIR", help="write one PNG per scenario into DIR")
    args = parser.parse_args(argv)
    names = SCENARIOS if args.scenario == "all" else (args.scenario,)
    closing: list[str] = []
    for name in names:
        started = time.monotonic()
        pooled = run_scenario(name, seeds=args.seeds or SCENARIO_SEEDS.get(name, 3), duration_s=args.duration,
                              processes=args.processes)
        print_table(name, pooled)
        if args.plots:
            path = plot(name, pooled, args.plots)
            if path:
                print(f"plot: {path}")
        lines = verdict(name, pooled)
        print(f"({name}: {time.monotonic() - started:.1f} s wall)")
        closing = lines
        print("\n".join(lines))
    # The last line of the last scenario is the figure this script is judged by.
    return 0 if closing else 1


if __name__ == "__main__":
    raise SystemExit(main())
