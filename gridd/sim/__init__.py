"""Simulated serving backends: an llm-d EPP pool or a vLLM server, for tests, demo and benchmarks.

model.py   pure queueing model (endpoints x max_seqs, TTFT then per-token pacing, counters)
metrics.py /metrics text from a model snapshot, EPP or vLLM flavour (pure)
app.py     raw ASGI app (OpenAI-compatible completions, /metrics, /admin) and start_sim()
cli.py     ``gridd sim`` entry point: main(argv)

Importing this package pulls in no trio; app.py and cli.py do.
"""

from gridd.sim.metrics import render_metrics
from gridd.sim.model import SimKnobs, SimModel, knobs_from

__all__ = ["SimKnobs", "SimModel", "knobs_from", "render_metrics"]
