"""Shared fixtures. Module-specific fixtures live in their test modules."""

from __future__ import annotations

import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
SAMPLES = SHARED / "reference" / "samples"


@pytest.fixture
def samples_dir() -> pathlib.Path:
    if not SAMPLES.is_dir():
        pytest.fail(f"reference samples not found at {SAMPLES} (shared/ must sit beside the checkout)")
    return SAMPLES
