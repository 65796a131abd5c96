"""Operator failure paths through real processes on loopback (issue 11).

- One of two providers hangs: the other's grid_provider_ready stays 1 at every /metrics
  scrape, and the hung one goes 0 once the readiness floor has passed.
- Clock steps and restarts, with operator a's wall clock shifted through gridd's own seam
  (GRIDD_WALL_CLOCK_OFFSET_S; the machine's clock is untouched) and peer b polling it over
  mutual TLS: an epoch claimed an hour ahead does not lock a out once its clock is right,
  and after a restart with the clock set back a's not-ready verdict still reaches b.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import httpx
import pytest
from realproc import PEERED_OPERATOR, Processes, series, wait_until

from gridd.childprocs import free_ports

pytestmark = pytest.mark.realproc

OPERATOR = """
role: operator
site: a
listen: {{metrics: "127.0.0.1:{metrics}"}}
control_socket: run/a.sock
state_dir: state/a
drain_grace_s: 2
timings: {{stale_metrics_s: 1}}
providers:
  - name: healthy
    model: sim-model
    settings: {{endpoint: "{healthy}/v1"}}
    metrics: {{url: "{healthy}/metrics", timeout_s: 5}}
  - name: hung
    model: sim-model
    settings: {{endpoint: "{hung}/v1"}}
    metrics: {{url: "{hung}/metrics", timeout_s: 5}}
"""


def ready_values(text: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^grid_provider_ready\{grid_provider="([^"]+)",grid_site="a"\} (\S+)$', text, re.M)}


def test_a_hung_provider_goes_not_ready_and_never_takes_the_healthy_one_with_it(tmp_path):
    (metrics_port,) = free_ports(1)
    with Processes(tmp_path) as procs:
        procs.start("sim-healthy", "sim", "--port", "0")
        procs.start("sim-hung", "sim", "--port", "0")
        sims = {name: procs.sim_url(f"sim-{name}") for name in ("healthy", "hung")}
        config = tmp_path / "a.yaml"
        config.write_text(OPERATOR.format(metrics=metrics_port, **sims))
        procs.start("a", "run", "--config", str(config))
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        wait_until(lambda: ready_values(httpx.get(url, timeout=2).text) == {"healthy": 1.0, "hung": 1.0},
                   "both providers ready")

        assert httpx.post(f"{sims['hung']}/admin", json={"metrics_hang": True}, timeout=2).status_code == 200
        switched = time.monotonic()
        # Every scrape for 12 s: the hung provider's last answer came at most one interval
        # (1 s) before the switch, and it is stale once 1 s + its 5 s timeout have passed
        # (the floor of the pass after the hung one), so it goes 0 from about 5 to 6 s after
        # the switch. The healthy one reads 1 at every scrape throughout.
        scrapes, went_down_after = 0, None
        while time.monotonic() - switched < 12.0:
            values = ready_values(httpx.get(url, timeout=2).text)
            scrapes += 1
            assert values.get("healthy") == 1.0, (time.monotonic() - switched, values)
            if went_down_after is None and values.get("hung") == 0.0:
                went_down_after = time.monotonic() - switched
            if went_down_after is not None:
                assert values.get("hung") == 0.0, values  # and it stays down
            time.sleep(0.1)
        assert scrapes >= 50
        assert went_down_after is not None
        print(f"{scrapes} scrapes; the hung provider read 0 from {went_down_after:.2f} s after the switch")
        # Not before the floor: the last answer was at most 1 s before the switch, and the
        # floor is 1 s + the 5 s pass.
        assert 5.0 <= went_down_after <= 8.0, went_down_after
        assert 'grid_provider_scrape_failures_total{grid_provider="hung",grid_site="a",reason="timeout"}' in \
            httpx.get(url, timeout=2).text




def certs(directory) -> None:
    for args in (["init"], ["issue", "--site", "a", "--role", "operator"],
                 ["issue", "--site", "b", "--role", "operator"]):
        done = subprocess.run([sys.executable, "-m", "gridd", "certs", args[0],
                               str(directory / "certs"), *args[1:]],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr


def a_epoch_at_b(text: str) -> int | None:
    found = series(text, "grid_provider_config_generation", grid_site="a")
    return int(found[0][0]["publisher_epoch"]) if found else None


def a_ready_at_b(text: str) -> float | None:
    found = series(text, "grid_provider_ready", grid_site="a")
    return found[0][1] if found else None


def test_clock_steps_and_restarts_never_lock_a_site_out(tmp_path):
    certs(tmp_path)
    ports = dict(zip(("met-a", "sig-a", "met-b", "sig-b"), free_ports(4), strict=True))

    def metrics(site: str) -> str:
        return httpx.get(f"http://127.0.0.1:{ports[f'met-{site}']}/metrics", timeout=2).text

    with Processes(tmp_path) as procs:
        procs.start("sim-a", "sim", "--port", "0")
        sim = procs.sim_url("sim-a")
        for site, peer in (("a", "b"), ("b", "a")):
            providers = (f'  - {{name: pa, model: sim-model, settings: {{endpoint: "{sim}/v1"}}, '
                         f'metrics: {{url: "{sim}/metrics", timeout_s: 2}}}}') if site == "a" else "  []"
            (tmp_path / f"{site}.yaml").write_text(PEERED_OPERATOR.format(
                site=site, certs="certs", metrics=ports[f"met-{site}"], signals=ports[f"sig-{site}"],
                providers=providers,
                peers=f'  - {{site: {peer}, url: "wss://127.0.0.1:{ports["sig-" + peer]}/signals"}}',
                timings="{peer_poll_interval_s: 1, peer_poll_budget_s: 2, stale_metrics_s: 1}"))
        procs.start("b", "run", "--config", "b.yaml")

        # 1. a's clock runs an hour ahead: it claims an epoch 3600 s ahead, which b (right
        #    clock, 600 s bound) drops as skew.
        procs.start("a", "run", "--config", "a.yaml", env={"GRIDD_WALL_CLOCK_OFFSET_S": "3600"})
        wait_until(lambda: series(metrics("b"), "grid_signals_ingest_dropped_total",
                                  reason="skew")[0][1] >= 1,
                   "b to drop a's future epoch as skew")
        assert a_epoch_at_b(metrics("b")) is None
        assert procs.stop("a") == 0
        future_epoch = int((tmp_path / "state" / "a" / "publisher_epoch").read_text())
        assert future_epoch >= time.time() + 3500

        # 2. The clock is corrected and a restarts: the high-water mark is beyond the bound,
        #    so the epoch restarts from the clock, and b admits a again at once (claiming
        #    above the mark kept a out for about 50 minutes).
        procs.start("a", "run", "--config", "a.yaml")
        epoch = wait_until(lambda: a_epoch_at_b(metrics("b")), "b to admit a after its clock was corrected")
        assert abs(epoch - time.time()) < 60 and epoch < future_epoch
        assert a_ready_at_b(metrics("b")) == 1.0
        assert series(metrics("a"), "grid_operator_publisher_epoch_clock_resets_total")[0][1] == 1.0
        assert re.search(r"^<4>gridd\.operator: publisher epoch \d+ was \d+ s ahead of the wall clock",
                         procs.log("a"), re.M)
        assert procs.stop("a") == 0

        # 3. a restarts with its clock 4 min back (within the skew bound, so the epoch is the
        #    high-water mark + 1), and its provider hangs: the not-ready verdict travels in
        #    verdict-only batches whose published_ms is 4 min behind what b last admitted.
        #    Ordered by (epoch, sequence) they are admitted, and b shows a not ready.
        procs.start("a", "run", "--config", "a.yaml", env={"GRIDD_WALL_CLOCK_OFFSET_S": "-240"})
        wait_until(lambda: a_epoch_at_b(metrics("b")) == epoch + 1, "b to admit a's next epoch")
        assert httpx.post(f"{sim}/admin", json={"metrics_hang": True}, timeout=2).status_code == 200
        wait_until(lambda: a_ready_at_b(metrics("b")) == 0.0, "b to show a not ready", deadline_s=20)
        assert series(metrics("a"), "grid_provider_ready", grid_site="a")[0][1] == 0.0
        stale = series(metrics("b"), "grid_signals_ingest_dropped_total", reason="stale_order")
        assert stale[0][1] == 0.0
