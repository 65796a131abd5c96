"""The fault suite runs as root with `ip netns` (CI does); elsewhere every test in it is
skipped with the reason. GRIDD_FAULT_LONG=1 runs the long variants (longer storms, more
fuzz-free load); see docs/reliability.md."""

from __future__ import annotations

import pytest

from fault.netgrid import Grid, issue_certs, unavailable_reason

_REASON = unavailable_reason()


def pytest_collection_modifyitems(config, items):
    if _REASON is None:
        return
    for item in items:
        if "/fault/" in str(item.fspath):
            item.add_marker(pytest.mark.skip(reason=_REASON))


@pytest.fixture(scope="session")
def fault_certs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fault-certs")
    # Issued 20 minutes back: the skew scenario's gateway runs 11 minutes behind.
    issue_certs(directory, issued_ago_s=1200)
    return directory


@pytest.fixture
def make_grid(tmp_path, fault_certs):
    """make_grid(**options) -> a Grid to use in a ``with`` block (it cleans up on the way out)."""
    def make(**options) -> Grid:
        return Grid(dir=tmp_path, certs=fault_certs, **options)
    return make
