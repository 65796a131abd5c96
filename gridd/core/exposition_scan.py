"""Which lines of a body the parser must see, picked in C (gridd.core.exposition's scan).

_scan(wanted) is one compiled regex per wanted set selecting, after each "\n", the lines whose
leading name is wanted and the lines that start with neither a name character nor '#'; every
other line is a comment or starts with an unwanted name, which the parser skips uncounted
(gridd/core/exposition.py explains why that leaves the result unchanged).
"""

from __future__ import annotations

import re

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def _name_alternation(names: list[str]) -> str:
    """A regex alternation matching exactly ``names`` (sorted, distinct), factored by common
    prefixes, so the engine tries a branch per distinct next character, not per name."""
    if names == [""]:
        return ""
    branches: dict[str, list[str]] = {}
    for name in names:
        if name:
            branches.setdefault(name[0], []).append(name[1:])
    alternatives = []
    for first, rests in branches.items():
        prefix = first
        # Extend the shared prefix while every rest goes on with the same character.
        while rests[0] and all(rest[:1] == rests[0][:1] for rest in rests):
            prefix += rests[0][0]
            rests = [rest[1:] for rest in rests]
        alternatives.append(re.escape(prefix) + _optional_group(rests))
    return "|".join(alternatives)


def _optional_group(rests: list[str]) -> str:
    if rests == [""]:
        return ""
    inner = _name_alternation([rest for rest in rests if rest])
    return f"(?:{inner})?" if "" in rests else f"(?:{inner})"


# wanted (as a frozenset) -> the pattern selecting the lines the parse must see (_scan), or
# None when the set holds something other than names.
_SCANS: dict[frozenset[object], re.Pattern[str] | None] = {}
_SCANS_MAX = 64


def _scan(wanted: frozenset[object] | set[object]) -> re.Pattern[str] | None:
    """The lines of a body, each after its "\n", that can change the result of a parse with
    ``wanted``: those whose leading name (the longest run of name characters, as
    _LEADING_NAME reads it) is a wanted name, and those that start with neither a name
    character nor '#' (blanks, digits, garbage: parsed, or counted as malformed, as before).
    Every other line starts with '#' or with an unwanted name: the line loop skips it
    without counting, so leaving it out changes nothing (module docstring)."""
    key = wanted if isinstance(wanted, frozenset) else frozenset(wanted)
    try:
        return _SCANS[key]
    except KeyError:
        pass
    names = [name for name in key if isinstance(name, str)]
    pattern = None
    if len(names) == len(key):
        alternation = _name_alternation(sorted(names))
        pattern = re.compile(r"\n((?:(?:" + alternation + r")(?![a-zA-Z0-9_:])|[^a-zA-Z_:#\n])[^\n]*)")
    if len(_SCANS) < _SCANS_MAX:
        _SCANS[key] = pattern
    return pattern


_KEPT_NAMES: dict[frozenset[object], dict[str, str]] = {}


def _kept_names(wanted: frozenset[object] | set[object]) -> dict[str, str]:
    """The names in ``wanted`` that are metric names (what classify keeps), per wanted set, each
    mapped to the set's own str object (the caller's constant: a parse read through a _Shape
    keys its samples by it, shared by every target and found by identity)."""
    key = wanted if isinstance(wanted, frozenset) else frozenset(wanted)
    found = _KEPT_NAMES.get(key)
    if found is None:
        found = {name: name for name in key if isinstance(name, str) and _METRIC_NAME.fullmatch(name)}
        if len(_KEPT_NAMES) < _SCANS_MAX:
            _KEPT_NAMES[key] = found
    return found
