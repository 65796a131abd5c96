"""The reference pages stay true: docs/config.md lists every config key with its default,
docs/troubleshooting.md every failure class, reason and state the code can report.
(docs/metrics.md is checked against real processes in tests/test_grid_realproc.py.)

Where the code keeps a set as a constant, the test reads the constant; where it does not
(condition reasons, status states, front outcomes), it reads the quoted values from the one
place in the source that produces them, so a new value there fails here until documented."""

from __future__ import annotations

import pathlib
import re
import typing

import msgspec.inspect as mi
import pytest
from docs_tables import table_rows

from gridd.config_schema import Config
from gridd.core.admission import DROP_REASONS
from gridd.core.candidates import EXCLUSION_REASONS, SIGNAL_STATES
from gridd.core.explain import CAPACITY_BOUNDS, OUTCOMES, TIERS
from gridd.core.feedback import FAILURE_REASONS
from gridd.core.readiness import FAILURE_CLASSES
from gridd.daemon import DAEMON_STATES
from gridd.link.session import CHANNEL_ERROR_REASONS
from gridd.operator.channel_setup import REFUSAL_REASONS
from gridd.operator.peers import PeerState
from gridd.preflight import TLS_FIXES
from gridd.probes.runner import PROBE_FAILURE_CLASSES

GRIDD = pathlib.Path(__file__).resolve().parent.parent / "gridd"


# -- docs/config.md -----------------------------------------------------------------------------


def _unwrap(t):
    while isinstance(t, mi.Metadata):
        t = t.type
    return t


def config_keys(struct: mi.StructType, prefix: str = ""):
    """(dotted key, default) for every key a config file can set. A plain sub-struct
    (``timings``) is a section: only its keys are listed. An optional one (``tls``) and a list
    of structs (``providers``) are keys themselves, and their fields follow with ``.``/``[].``."""
    for field in struct.fields:
        t = _unwrap(field.type)
        optional = False
        if isinstance(t, mi.UnionType):
            present = [_unwrap(x) for x in t.types if not isinstance(x, mi.NoneType)]
            optional = len(present) < len(t.types)
            t = present[0] if len(present) == 1 else t
        key = prefix + field.name
        if isinstance(t, mi.StructType) and not optional:
            yield from config_keys(t, key + ".")
            continue
        if field.default is not mi.NODEFAULT:
            default = field.default
        elif field.default_factory is not mi.NODEFAULT:
            default = field.default_factory()
        else:
            default = mi.NODEFAULT
        yield key, default
        if isinstance(t, mi.StructType):
            yield from config_keys(t, key + ".")
        if isinstance(t, mi.ListType) and isinstance(_unwrap(t.item_type), mi.StructType):
            yield from config_keys(_unwrap(t.item_type), key + "[].")


def rendered(default) -> str | None:
    """How docs/config.md writes a default; None where prose describes it."""
    if default is mi.NODEFAULT:
        return "required"
    if default is None:
        return "—"
    if isinstance(default, bool):
        return "true" if default else "false"
    if isinstance(default, float) and default.is_integer():
        return str(int(default))
    if isinstance(default, int | float):
        return str(default)
    if isinstance(default, str):
        return f"`{default}`"
    if default in ([], {}):
        return f"`{default!r}`"
    return None


def test_config_md_lists_every_key_with_its_default():
    keys = dict(config_keys(mi.type_info(Config)))
    documented = table_rows("config.md", "Every key")
    assert sorted(documented) == sorted(keys)
    wrong = {}
    for key, default in keys.items():
        cell, meaning = documented[key][0], documented[key][1]
        want = rendered(default)
        # "— (TTL/2)": the first word is the default, the rest explains a derived value.
        if want is not None and cell.split(" ")[0] != want:
            wrong[key] = (cell, want)
        assert meaning, f"{key}: no meaning"
    assert wrong == {}


def test_config_keys_cover_nested_lists_and_optional_blocks():
    keys = dict(config_keys(mi.type_info(Config)))
    assert keys["providers[].settings.probes[].aggregate.window"] == 20
    assert keys["providers[].metrics"] is None and keys["providers[].metrics.url"] is mi.NODEFAULT
    assert keys["timings.stale_metrics_s"] is None and "timings" not in keys


# -- docs/troubleshooting.md ----------------------------------------------------------------------


def _found(path: str, pattern: str) -> set[str]:
    """Every value ``pattern``'s groups captured in the source file."""
    text = (GRIDD / path).read_text(encoding="utf-8")
    return {g for m in re.finditer(pattern, text) for g in m.groups() if g is not None}


def test_source_readers_find_what_they_look_for():
    # The readers below must not pass vacuously.
    assert len(_found("core/readiness.py", r'Verdict\((?:True|False|None), "(\w+)"')) == 11


STATUS_STATES = (
    set(DAEMON_STATES)
    | set(typing.get_args(PeerState))
    | _found("gateway/service.py", r'self\.operator_state(?:, self\.last_poll_error)? = "([^"]+)"')
    | _found("probes/runner.py",
             r'why = "([a-z ]+)"|"provider disabled" if|\("(provider disabled)"|else "(stopped)"\)'
                                 r'|"state": "(failing)" if|else "(ok)",')
)


@pytest.mark.parametrize(("section", "values"), [
    ("Scrape failure classes", set(FAILURE_CLASSES)),
    ("Probe failure classes", set(PROBE_FAILURE_CLASSES) - set(FAILURE_CLASSES)),
    ("Signals channel failure classes", set(CHANNEL_ERROR_REASONS)),
    ("Connections refused by an operator", set(REFUSAL_REASONS)),
    ("Ingest drop reasons", set(DROP_REASONS)),
    ("Feedback failure reasons", set(FAILURE_REASONS)),
    ("Ready condition reasons", _found("core/readiness.py", r'Verdict\((?:True|False|None), "(\w+)"')),
    ("GatewayAgesRejected reasons",
     _found("core/feedback.py", r'"reason": "(\w+)"|reason, message = "(\w+)"')),
    ("Gateway exclusion reasons", set(EXCLUSION_REASONS)),
    ("Gateway signal states", set(SIGNAL_STATES)),
    ("Explain tiers", set(TIERS)),
    ("Explain capacity bounds", set(CAPACITY_BOUNDS)),
    ("Explain outcomes", set(OUTCOMES)),
    ("Status states", STATUS_STATES),
    ("Front answers", _found("gateway/front.py", r'metrics\.request\([^)]*"(\w+)"\)')
     | _found("gateway/forwarding.py", r'exchange\.outcome = "(\w+)"')
     | _found("gateway/forwarding.py", r'exchange\.outcome = "\w+" if [^\n]* else "(\w+)"')),
    ("Certificate problems (`gridd check-config`, start, reload)", set(TLS_FIXES)),
])
def test_troubleshooting_md_explains_every_value(section, values):
    rows = table_rows("troubleshooting.md", section)
    assert values, section
    assert sorted(rows) == sorted(values)
    assert all(cells[-1] and cells[0] for cells in rows.values())
