"""Shared fixtures. Module-specific fixtures live in their test modules."""

from __future__ import annotations

import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
# Reference expositions (llm-d EPP and vLLM), hand-written to the facts in docs/epp-metrics.md.
SAMPLES = REPO / "tests" / "data" / "samples"


@pytest.fixture
def samples_dir() -> pathlib.Path:
    return SAMPLES
