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

import errno
import logging
import os
import pathlib
import stat
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import trio

from gridd.config import LoadedConfig
from gridd.errors import ConfigError, StateError
from gridd.state import write_durably

log = logging.getLogger("gridd.probes")

RunIO = Callable[..., Awaitable[Any]]
"""Runs a blocking callable off the event loop: ``await run_io(fn, *args)``."""

SINK_ERRORS = (OSError, StateError)


ATTRIBUTES_NAMESPACE = "attributes"
"""Spec 004: ``prefix: attributes.probe`` (the default) is generic live metadata that
"surfaces as ``probe.<name>`` in ``metadata.to_dict()``": the seed's metadata flattens its
``attributes`` map into the top level. gridd stores the key as it surfaces."""


def metadata_key(prefix: str, name: str) -> str:
    """The key a value surfaces under: ``<prefix>.<name>``, a leading ``attributes.`` segment
    dropped (``attributes.probe`` -> ``probe.<name>``, ``attributes`` -> ``<name>``)."""
    if prefix == ATTRIBUTES_NAMESPACE:
        prefix = ""
    elif prefix.startswith(ATTRIBUTES_NAMESPACE + "."):
        prefix = prefix[len(ATTRIBUTES_NAMESPACE) + 1:]
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
        self.published_at: float | None = None
        """When (monotonic) the values were produced: the age receivers read them at."""
        self.closed = False

    def publish(self, aggregates: dict[str, float], at: float) -> None:
        """This tick's aggregates replace the last tick's: a series the tick no longer has
        leaves the metadata with it. ``at``: the tick's time."""
        if self.closed:
            return
        self.values = {metadata_key(self.prefix, name): value for name, value in aggregates.items()}
        self.published_at = at
        self._changed(self.provider)

    def close(self) -> None:
        """The probe stopped; the runner merges again without these values."""
        self.closed = True
        self.values = {}
        self.published_at = None


def _open_regular(path: pathlib.Path, flags: int) -> int:
    """Open a history file, refusing anything but a regular file: no symlink (O_NOFOLLOW), no
    device or FIFO (O_NONBLOCK, then fstat), since a sink path pointing at /dev/zero or a FIFO
    would block a worker thread that cannot be cancelled."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"{path} is not a regular file")
    os.set_blocking(fd, True)
    return fd


def _count_lines(path: pathlib.Path) -> tuple[int, bool]:
    """(records in the file, whether its last line lacks a newline). Missing file: (0, False)."""
    lines = 0
    last = b""
    try:
        with os.fdopen(_open_regular(path, os.O_RDONLY), "rb") as fh:
            while chunk := fh.read(1 << 20):
                lines += chunk.count(b"\n")
                last = chunk[-1:]
    except FileNotFoundError:
        return 0, False
    partial = last not in (b"", b"\n")
    return lines + (1 if partial else 0), partial


def _check_inside(path: pathlib.Path, root: pathlib.Path) -> None:
    """Raise OSError unless ``path``'s directory, symlinks followed, is ``root`` or below it:
    a directory swapped for a symlink after the config was checked cannot lead a sink out."""
    real_root = os.path.realpath(root)
    real_dir = os.path.realpath(path.parent)
    if real_dir != real_root and not real_dir.startswith(real_root.rstrip(os.sep) + os.sep):
        raise OSError(errno.EACCES, f"{path} leads outside the workspace {root} (to {real_dir})")


class JsonlHistory:
    """One JSONL file, shared by every file sink that names it (they serialise on a lock).
    ``root``: the workspace the file must stay under (checked on every append)."""

    def __init__(self, path: pathlib.Path, max_entries: int, run_io: RunIO, *,
                 root: pathlib.Path | None = None) -> None:
        self.path = path
        self.root = root
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
            if self.root is not None:
                _check_inside(self.path, self.root)
            if self.lines is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                if self.root is not None:
                    _check_inside(self.path, self.root)
                self.lines, partial = _count_lines(self.path)
                if partial:
                    prefix = b"\n"
            with os.fdopen(_open_regular(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "ab") as fh:
                fh.write(prefix + record)
            self.lines += 1
            if self.max_entries and self.lines > self.max_entries + self.slack:
                self._compact()
        except BaseException:
            self.lines = None  # unknown after a failure: count again on the next append
            raise

    def _compact(self) -> None:
        tail: deque[bytes] = deque(maxlen=self.max_entries)
        with os.fdopen(_open_regular(self.path, os.O_RDONLY), "rb") as fh:
            tail.extend(fh)
        write_durably(self.path, b"".join(tail))
        self.lines = len(tail)
        self.compactions += 1


class FileSink:
    kind = "file"

    def __init__(self, history: JsonlHistory, *, provider: str, probe: str,
                 wall: Callable[[], float]) -> None:
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


def check_sink_paths(loaded: LoadedConfig) -> None:
    """File sinks live under the workspace (docs/security.md): no absolute path outside it, no
    ``..`` (refused by the config decoder), no symlink out of it (the path is resolved). And
    even there a sink must not write over the daemon's own files: its config, its TLS
    material, its control socket or anything in its state directory (a sink appends to and
    rewrites its file). Raises ConfigError naming the sink."""
    cfg = loaded.config
    workspace = loaded.workspace.resolve()
    own = {loaded.path.resolve()}
    if cfg.tls is not None:
        own |= {loaded.resolve(p).resolve() for p in (cfg.tls.cert, cfg.tls.key, cfg.tls.ca)}
    if cfg.control_socket:
        own.add(loaded.resolve(cfg.control_socket).resolve())
    state = loaded.resolve(cfg.state_dir).resolve()
    for i, provider in enumerate(cfg.providers):
        for j, probe in enumerate(provider.settings.probes):
            for k, sink in enumerate(probe.publish):
                if sink.to != "file" or not sink.path:
                    continue
                target = loaded.resolve(sink.path).resolve()
                if workspace not in target.parents:
                    raise ConfigError(f"providers[{i}].settings.probes[{j}].publish[{k}].path: {sink.path!r} "
                                      f"is outside the workspace {workspace} (file sinks live under it: a "
                                      "relative path, no '..', no symlink out of it)")
                if target in own or target == state or state in target.parents:
                    raise ConfigError(f"providers[{i}].settings.probes[{j}].publish[{k}].path: {sink.path!r} "
                                      "would write over gridd's own files "
                                      "(config, TLS, control socket, state)")
