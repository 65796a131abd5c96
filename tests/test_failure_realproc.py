"""Operator failure paths through real processes on loopback (issue 11).

- One of two providers hangs: the other's grid_provider_ready stays 1 at every /metrics
  scrape, and the hung one goes 0 once the readiness floor has passed.
"""

from __future__ import annotations

import re
import time

import httpx
import pytest
from realproc import Processes, free_ports, wait_until

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
    procs = Processes(tmp_path)
    try:
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
        # Not before the floor: the last answer was at most 1 s before the switch, and the
        # floor is 1 s + the 5 s pass.
        assert 5.0 <= went_down_after <= 8.0, went_down_after
        assert 'grid_provider_scrape_failures_total{grid_provider="hung",grid_site="a",reason="timeout"}' in \
            httpx.get(url, timeout=2).text
    except BaseException:
        for name in ("a", "sim-healthy", "sim-hung"):
            if (tmp_path / f"{name}.log").exists():
                print(f"--- {name}.log\n{procs.log(name)[-3000:]}")
        raise
    finally:
        procs.stop_all()
