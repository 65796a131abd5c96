"""Instructions per call of the operator's per-scrape parse, counted by valgrind (issue 16).

CPU seconds on this shared VM move with the host's phase by more than a change is worth
(docs/scaling.md); instruction counts do not: callgrind gives the same total for the same
binary, inputs and environment, whatever else the machine is doing. Each target runs in a
child under ``valgrind --tool=callgrind`` twice, with 0 and with N calls after the same
set-up, and the difference over N is printed per call:

- on_scrape: ProviderPublisher.on_scrape in steady state (four publishers in turn, each
  body a new rendering of tests/data/samples/epp-healthy.prom with its counters moved:
  scale.CountingBody), everything a scrape's result costs in gridd/core;
- scan: the line scan alone (gridd.core.exposition_scan._scan(WANTED_SAMPLES).findall), the
  lines of a body that the parse must see;
- line_starts: a pattern that starts a match at every line and fails at once, the part of
  the scan no pattern of its kind can avoid (find each "\\n", start a match there);
- names_only: the scan without the rest of each picked line (what reading the picked lines'
  values and labels adds to it).

Needs valgrind (Debian package); bounded: 2 children per target, N calls each.
Run: .venv/bin/python benchmarks/scan_instructions.py [--calls N]
"""

from __future__ import annotations

import argparse
import itertools
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

TARGETS = ("on_scrape", "scan", "line_starts", "names_only")


def target(name: str) -> Callable[[int], object]:
    """The call to count, after its set-up (the set-up is the same with 0 calls)."""
    from scale import SAMPLE, CountingBody

    from gridd.core.derivation import WANTED_SAMPLES
    from gridd.core.exposition_scan import _scan
    from gridd.core.publication import ProviderPublisher

    renderer = CountingBody(SAMPLE.read_bytes())
    bodies = [renderer.render(scrape) for scrape in range(8)]
    texts = ["\n" + body.decode() for body in bodies]
    scan = _scan(WANTED_SAMPLES)
    assert scan is not None
    if name == "on_scrape":
        sequence = itertools.count(1)
        publishers = [
            ProviderPublisher(site="a", provider=f"p{i}", model="m", provider_uid=f"u{i}", generation=1,
                              publisher_epoch=1, created_at=0.0, next_sequence=sequence.__next__)
            for i in range(4)
        ]

        def scrape(call: int) -> object:
            now = float(call // 4)
            return publishers[call % 4].on_scrape(now=now, wall_now=1e9 + now, body=bodies[call // 4 % 8],
                                                  failure_class=None, stale_after_s=5.0, unavailable=False)

        for call in range(12):  # three scrapes each: every publisher has its shape
            scrape(call)
        return lambda call: scrape(call + 12)
    if name == "scan":
        pattern = scan
    elif name == "line_starts":
        pattern = re.compile("\n(zzz)")
    else:
        cut = scan.pattern.replace("[^\\n]*)", ")")
        assert cut != scan.pattern
        pattern = re.compile(cut)
    return lambda call: pattern.findall(texts[call % 8])


def child(name: str, calls: int) -> None:
    run = target(name)
    for call in range(calls):
        run(call)


def instructions(name: str, calls: int) -> int:
    out = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, __file__,
         "--child", name, str(calls)],
        capture_output=True, text=True, timeout=600, check=True,
    )
    found = re.search(r"Collected : (\d+)", out.stderr)
    if found is None:
        raise SystemExit(f"no instruction count from valgrind:\n{out.stderr[-2000:]}")
    return int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100, help="counted calls per target (default 100)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]))
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("needs valgrind (apt-get install valgrind)")
    per_call = {
        name: (instructions(name, args.calls) - instructions(name, 0)) / args.calls for name in TARGETS
    }
    for name, count in per_call.items():
        print(f"{name:12s} {count / 1e6:6.3f} M instructions per call")
    print(f"scan share of on_scrape: {per_call['scan'] / per_call['on_scrape']:.2f}")


if __name__ == "__main__":
    main()
