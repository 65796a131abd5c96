"""Prometheus text exposition parser (interface; the fast implementation replaces the body).

parse_exposition(body, wanted) -> Exposition
    body: the raw /metrics body (bytes, UTF-8) or str.
    wanted: sample names to keep exactly as they appear on sample lines
        (e.g. "llm_d_epp_request_ttft_seconds_bucket"); None keeps every sample.
    Exposition.samples: sample name -> list of (labels dict, value float), in input order.
    Exposition.malformed_lines: lines that could not be parsed (skipped, never fatal).
"""

from __future__ import annotations

import re
from collections.abc import Container

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+-?\d+)?\s*$')
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


class Exposition:
    __slots__ = ("samples", "malformed_lines")

    def __init__(self) -> None:
        self.samples: dict[str, list[tuple[dict[str, str], float]]] = {}
        self.malformed_lines = 0


def parse_exposition(body: bytes | str, wanted: Container[str] | None = None) -> Exposition:
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    out = Exposition()
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            out.malformed_lines += 1
            continue
        name = m.group(1)
        if wanted is not None and name not in wanted:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            out.malformed_lines += 1
            continue
        labels = {k: v.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")
                  for k, v in _LABEL.findall(m.group(2) or "")}
        out.samples.setdefault(name, []).append((labels, value))
    return out
