"""Where a probe's aggregates go (spec 004, Publishing): provider metadata and JSONL history.

MetadataSink holds ``<prefix>.<name>`` values that the runner merges into the provider's
ProviderPublisher.probes, which goes into every Batch the operator publishes for it, so the
next batch carries fresh values to the gateways and their next routing decision uses them.
It is synchronous: it only updates dicts on the event loop.

JsonlHistory owns one history file; FileSink appends one record per successful tick,
``{"ts", "provider", "probe", "aggregates"}`` (ts: wall-clock seconds). File IO runs off the
event loop (``run_io``, trio.to_thread.run_sync by default; injected in tests). The cap
(``max_entries``) is amortised: the line count is taken once when the file is first used
(a partial last line, left by a crash mid-append, is terminated first so the next record
starts on its own line); appends only add to the count; once the file holds more than
``max_entries + slack`` records (slack = max(1, max_entries // 10)) it is rewritten keeping
the newest ``max_entries``, through a temporary file renamed over it (gridd.state.
write_durably), so a reader never sees a half-written file. The file therefore holds at
least the newest ``max_entries`` records and never more than ``max_entries + slack``; a
rewrite costs O(max_entries) and happens once per ``slack`` appends, O(1) per tick.
``max_entries: 0`` disables the cap. Appends are not fsynced (history, not state).
"""

from __future__ import annotations

import logging
import os
import pathlib
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import trio

from gridd.errors import StateError
from gridd.state import write_durably

log = logging.getLogger("gridd.probes")

RunIO = Callable[..., Awaitable[Any]]
"""Runs a blocking callable off the event loop: ``await run_io(fn, *args)``."""

SINK_ERRORS = (OSError, StateError)


def metadata_key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class MetadataSink:
    """This probe's current ``<prefix>.<name>`` values. The runner merges the metadata sinks
    of a provider's running probes into its ProviderPublisher.probes (``changed``), so a
    probe that stops takes exactly its own values with it."""

    kind = "metadata"

    def __init__(self, provider: str, prefix: str, changed: Callable[[str], None]) -> None:
        self.provider = provider
        self.prefix = prefix
        self._changed = changed
        self.values: dict[str, float] = {}
        self.closed = False

    def publish(self, aggregates: dict[str, float]) -> None:
        """This tick's aggregates replace the last tick's: a series the tick no longer has
        leaves the metadata with it."""
        if self.closed:
            return
        self.values = {metadata_key(self.prefix, name): value for name, value in aggregates.items()}
        self._changed(self.provider)

    def close(self) -> None:
        """The probe stopped; the runner merges again without these values."""
        self.closed = True
        self.values = {}


def _count_lines(path: pathlib.Path) -> tuple[int, bool]:
    """(records in the file, whether its last line lacks a newline). Missing file: (0, False)."""
    lines = 0
    last = b""
    try:
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 20):
                lines += chunk.count(b"\n")
                last = chunk[-1:]
    except FileNotFoundError:
        return 0, False
    partial = last not in (b"", b"\n")
    return lines + (1 if partial else 0), partial


class JsonlHistory:
    """One JSONL file, shared by every file sink that names it (they serialise on a lock)."""

    def __init__(self, path: pathlib.Path, max_entries: int, run_io: RunIO) -> None:
        self.path = path
        self.max_entries = max_entries
        self.run_io = run_io
        self.lines: int | None = None
        """Records in the file as far as we know; None until counted (or after an IO error)."""
        self.compactions = 0
        self._lock = trio.Lock()

    @property
    def slack(self) -> int:
        return max(1, self.max_entries // 10)

    async def append(self, record: bytes) -> None:
        """Append one record (one line, newline included). Raises OSError or StateError."""
        async with self._lock:
            await self.run_io(self._append_sync, record)

    def _append_sync(self, record: bytes) -> None:
        try:
            prefix = b""
            if self.lines is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self.lines, partial = _count_lines(self.path)
                if partial:
                    prefix = b"\n"
            with open(self.path, "ab") as fh:
                fh.write(prefix + record)
            self.lines += 1
            if self.max_entries and self.lines > self.max_entries + self.slack:
                self._compact()
        except BaseException:
            self.lines = None  # unknown after a failure: count again on the next append
            raise

    def _compact(self) -> None:
        tail: deque[bytes] = deque(maxlen=self.max_entries)
        with open(self.path, "rb") as fh:
            tail.extend(fh)
        write_durably(self.path, b"".join(tail))
        self.lines = len(tail)
        self.compactions += 1


class FileSink:
    kind = "file"

    def __init__(self, history: JsonlHistory, *, provider: str, probe: str, wall: Callable[[], float]) -> None:
        self.history = history
        self.provider = provider
        self.probe = probe
        self.wall = wall

    async def publish(self, aggregates: dict[str, float]) -> None:
        record = msgspec.json.encode({"ts": self.wall(), "provider": self.provider, "probe": self.probe,
                                      "aggregates": aggregates})
        await self.history.append(record + b"\n")


def file_sink_path(resolve: Callable[[str], pathlib.Path], path: str) -> pathlib.Path:
    """File paths are workspace-relative (spec 004): LoadedConfig.resolve, normalised so two
    spellings of one file share one JsonlHistory."""
    return pathlib.Path(os.path.normpath(resolve(path)))
