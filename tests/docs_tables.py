"""Read the reference tables of docs/ (rows starting with a backticked key), so tests can
compare them with the code: docs/config.md with the config Structs, docs/metrics.md with what
the exporters expose, docs/troubleshooting.md with the failure classes and reasons."""

from __future__ import annotations

import pathlib
import re

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
_ROW = re.compile(r"^\| `([^`]+)` \|(.*)\|\s*$")


def table_rows(page: str, section: str | None = None) -> dict[str, list[str]]:
    """{key: [the other cells]} for every table row whose first cell is one backticked key,
    in the whole page or only under the ``## section`` heading."""
    rows: dict[str, list[str]] = {}
    current = None
    for line in (DOCS / page).read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            current = line[3:].strip()
        m = _ROW.match(line)
        if m and (section is None or current == section):
            key = m.group(1)
            assert key not in rows, f"docs/{page}: {key} is listed twice"
            rows[key] = [cell.strip() for cell in m.group(2).split(" | ")]
    return rows


def backticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)
