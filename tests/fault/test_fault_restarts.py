"""Processes failing and changing under load on the namespaced two-site grid (netgrid.py):
an operator killed with SIGKILL and restarted, a gateway whose clock runs 11 minutes behind
(through gridd's clock seam), SIGHUP storms, certificate rotation on every host, a provider
flapping ready/not-ready."""

from __future__ import annotations

import os
import re
import shutil
import signal
import time

import pytest
from realproc import wait_until

from fault.netgrid import SITES, Load, series, total

pytestmark = pytest.mark.realproc

SLACK_S = 3.0
LONG = os.environ.get("GRIDD_FAULT_LONG") == "1"


def epoch_of(grid, observer: str, site: str) -> int | None:
    """The publisher epoch of ``site``'s provider as operator ``observer`` holds it."""
    found = series(grid.metrics(observer), "grid_provider_config_generation", grid_site=site)
    return int(found[0][0]["publisher_epoch"]) if found else None


def test_operator_sigkill_and_restart_under_load(make_grid):
    with make_grid() as grid, Load(grid, "a", workers=3) as load_a, Load(grid, "b", workers=2) as load_b:
        time.sleep(1)
        before = epoch_of(grid, "b", "a")
        stored = int((grid.dir / "state" / "op-a" / "publisher_epoch").read_text())
        assert before == stored
        killed = time.monotonic()
        grid.procs.kill("op-a")  # SIGKILL: no drain, nothing flushed
        # Gateway a keeps routing from its last snapshot while its operator is gone.
        time.sleep(1.5)
        during = load_a.since(killed + 0.1, time.monotonic())
        assert during and all(o.status == 200 for o in during), during[:3]
        grid.start("op", "a")
        # The restarted operator publishes above its high-water mark, and b admits it.
        after = wait_until(lambda: (e := epoch_of(grid, "b", "a")) and e > before and e,
                           "b admitting a's new epoch", deadline_s=30)
        assert after == int((grid.dir / "state" / "op-a" / "publisher_epoch").read_text())
        back = time.monotonic() - killed
        wait_until(lambda: grid.candidates("a")["a"]["signal"] == "fresh"
                   and grid.status("gw-a")["role_status"]["operator_state"] == "up",
                   "gateway a back on its operator")
        # Sample b's view for a while: the epoch never goes back (no batch of the old epoch,
        # delayed in a poll under way at the kill, is admitted after the new one).
        seen: list[int] = []
        for _ in range(6):
            epoch = epoch_of(grid, "b", "a")
            assert epoch is not None, seen
            seen.append(epoch)
            time.sleep(0.5)
        assert seen == sorted(seen) and seen[0] == after, seen
        drops_b = total(grid.metrics("b"), "grid_signals_ingest_dropped_total", reason="skew")
        assert drops_b == 0
    assert load_a.wrong() == [] and load_b.wrong() == []
    print(f"operator kill -9: new epoch {after} (was {before}) admitted at b {back:.1f} s after the kill; "
          f"{len(load_a.outcomes)} + {len(load_b.outcomes)} requests, none failed")


def gateway_b_skew_drops(grid) -> float:
    return total(grid.metrics("b", "gw"), "grid_signals_ingest_dropped_total", reason="skew")


def rejected_count(grid) -> tuple[str, int]:
    """(status, skew drops) of gateway b's GatewayAgesRejected condition at operator b."""
    conditions = grid.status("op-b")["role_status"]["gateway_feedback"]["conditions"]
    [cond] = [c for c in conditions if c["replica"] == "g1"]
    m = re.search(r"rejected (\d+) batch", cond["message"])
    return cond["status"], int(m.group(1)) if m else 0


def hup_storm(grid, names: list[str], seconds: float, per_second: int = 10) -> int:
    sent = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for name in names:
            os.kill(grid.pid(name), signal.SIGHUP)
            sent += 1
        time.sleep(1 / per_second)
    return sent


def test_gateway_clock_11_minutes_behind_through_a_sighup_storm(make_grid):
    """Gateway b's wall clock 660 s behind (GRIDD_WALL_CLOCK_OFFSET_S): every batch its
    operator publishes is 660 s ahead of it, beyond the 600 s bound, so it is dropped as skew,
    counted, and reported to operator b, which raises GatewayAgesRejected. A SIGHUP storm
    (10 a second on both of b's processes) meanwhile loses none of that evidence. Fixed
    (restarted with the right clock), the condition clears after 5 clean reports (about 5 s
    at the 1 s poll)."""
    storm_s = 30.0 if LONG else 10.0
    with make_grid(env={"gw-b": {"GRIDD_WALL_CLOCK_OFFSET_S": "-660"}}, converge=("a",)) as grid:
        wait_until(lambda: gateway_b_skew_drops(grid) >= 3,
                   "gateway b dropping its operator's batches as skew")
        status, count = wait_until(lambda: (r := rejected_count(grid))[0] == "True" and r,
                                   "GatewayAgesRejected raised at operator b")
        assert count >= 1
        assert series(grid.metrics("b"), "grid_signals_gateway_replicas_rejecting")[0][1] == 1.0

        counts, sent, stormed = [count], 0, time.monotonic()
        while time.monotonic() - stormed < storm_s:
            sent += hup_storm(grid, ["op-b", "gw-b"], 1.0)
            counts.append(rejected_count(grid)[1])
        time.sleep(1)
        counts.append(rejected_count(grid)[1])
        # The evidence only grows through the storm, and kept growing (gateway b still skewed).
        assert counts == sorted(counts) and counts[-1] > counts[0], counts
        assert rejected_count(grid)[0] == "True"
        for name in ("op-b", "gw-b"):
            assert grid.status(name)["last_reload"]["result"] == "ok", name
        assert total(grid.metrics("b"), "gridd_config_reloads_total", result="error") == 0
        gateway_drops = total(grid.metrics("b", "gw"), "grid_signals_ingest_dropped_total", reason="skew")
        assert grid.status("gw-b")["role_status"]["feedback"]["skew_drops"] >= gateway_drops - 2

        # The fix: gateway b restarted with the right clock.
        assert grid.procs.stop("gw-b") == 0
        fixed = time.monotonic()
        grid.env["gw-b"] = {}
        grid.start("gw", "b")
        wait_until(lambda: rejected_count(grid)[0] == "False", "GatewayAgesRejected cleared",
                   deadline_s=5 * 1.0 + 10 + SLACK_S)
        cleared_after = time.monotonic() - fixed
        [cond] = grid.status("op-b")["role_status"]["gateway_feedback"]["conditions"]
        assert cond["reason"] == "ReportsClean", cond
        assert series(grid.metrics("b"), "grid_signals_gateway_replicas_rejecting")[0][1] == 0.0
        wait_until(lambda: grid.get("b", "http://127.0.0.1:8080/readyz").status_code == 200,
                   "gateway b ready")
        assert grid.candidates("b")["b"]["signal"] == "fresh"
    print(f"skew: {counts[0]} -> {counts[-1]} rejected batches reported through {sent} SIGHUPs "
          f"in {storm_s:.0f} s; cleared {cleared_after:.1f} s after the fixed gateway started")


def reissue_leaves(grid_dir, days: int) -> None:
    """`gridd certs issue` again for every host, into a copy of the grid's certificates, then
    the `certs` symlink switched to the copy by one atomic rename (how a mounted secret is
    updated). Written in place, a key and its certificate are two renames: a reload between
    them reads a new key with the old certificate and is rejected (seen under load)."""
    from contextlib import redirect_stdout

    import gridd.certs

    live = grid_dir / "certs"
    new = grid_dir / f"certs.{time.monotonic_ns()}"
    shutil.copytree(live.resolve(), new)
    with redirect_stdout(None):
        for site in SITES:
            for role in (["--role", "operator"], ["--role", "gateway", "--replica", "g1"]):
                args = ["issue", str(new), "--site", site, *role, "--days", str(days)]
                assert gridd.certs.main(args) == 0
    os.symlink(new.name, grid_dir / "certs.next")
    os.replace(grid_dir / "certs.next", live)


def test_certificate_rotation_on_every_host_during_a_sighup_storm_under_load(make_grid):
    """Traffic at both sites; every gridd process gets 10 SIGHUPs a second for 10 s, and
    half-way through every host's leaf is reissued (a different expiry, so the change shows).
    No request fails; every reload commits; the operators serve the new certificate and
    every link is up on it."""
    storm_s = 30.0 if LONG else 10.0
    with make_grid() as grid, Load(grid, "a", workers=3) as load_a, \
            Load(grid, "b", workers=3) as load_b:
        names = [f"{kind}-{site}" for kind in ("op", "gw") for site in SITES]
        old_not_after = {site: grid.status(f"op-{site}")["role_status"]["signals"]["tls_not_after"]
                         for site in SITES}
        sent = hup_storm(grid, names, storm_s / 2)
        rotated = time.monotonic()
        reissue_leaves(grid.dir, days=30)
        sent += hup_storm(grid, names, storm_s / 2)
        for site in SITES:
            new = wait_until(lambda site=site: (n := grid.status(f"op-{site}")["role_status"]["signals"][
                "tls_not_after"]) != old_not_after[site] and n, f"operator {site} on its new certificate")
            assert new < old_not_after[site]  # 30 days instead of the default
        for name in names:
            last_reload = grid.status(name)["last_reload"]
            assert last_reload["result"] == "ok", (name, last_reload)
        for site in SITES:
            assert total(grid.metrics(site), "gridd_config_reloads_total", result="error") == 0
            assert total(grid.metrics(site, "gw"), "gridd_config_reloads_total", result="error") == 0
        # The links came back up on the new certificates: fresh readings keep arriving.
        rejoined = time.monotonic()
        for site in SITES:
            wait_until(lambda site=site: all(c["signal"] == "fresh"
                                             and c["age_s"] < time.monotonic() - rejoined + 2
                                             for c in grid.candidates(site).values()),
                       f"gateway {site} fresh after the rotation")
            assert grid.status(f"op-{site}")["role_status"]["peers"][0]["state"] == "up"
        time.sleep(1)
    for load in (load_a, load_b):
        assert load.wrong() == [], load.wrong()[:3]
        assert {o.status for o in load.outcomes} == {200}
        assert len(load.since(rotated)) >= 10
    print(f"rotation: {sent} SIGHUPs over {storm_s:.0f} s, "
          f"{len(load_a.outcomes) + len(load_b.outcomes)} requests, all 200")


def test_a_gateway_dropping_every_batch_as_skew_answers_503_not_404(make_grid):
    """docs/routing.md: a gateway that cannot tell which models exist never says 404. One
    whose clock is 11 minutes behind drops every batch its operator relays (skew), so it
    holds no candidate: it has no routing data, whatever its polls return."""
    with make_grid(env={"gw-b": {"GRIDD_WALL_CLOCK_OFFSET_S": "-660"}}, converge=("a",)) as grid:
        wait_until(lambda: gateway_b_skew_drops(grid) >= 3,
                   "gateway b dropping its operator's batches as skew")
        assert grid.candidates("b") == {}
        with Load(grid, "b", workers=1) as load_b, Load(grid, "a", workers=2) as load_a:
            time.sleep(2)
        assert grid.get("b", "http://127.0.0.1:8080/readyz").status_code == 503
        assert {o.status for o in load_b.outcomes} == {503}, {o.status for o in load_b.outcomes}
        # a's requests picked for b get b's 503, retried at a: all 200 (today: b's 404, relayed).
        assert load_a.wrong() == [] and load_b.wrong() == []
