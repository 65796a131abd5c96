"""The config file the providers API persists to. Blocking: called through ``run_io``, off
the event loop."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping
from typing import Any

import yaml

from gridd.api.errors import ApiError
from gridd.state import write_durably

__all__ = ["read_unchanged", "write_config"]


def read_unchanged(path: pathlib.Path, running: Mapping[str, Any]) -> bytes:
    """The config file's bytes, provided they are the tree the daemon runs. A file edited by
    hand and not reloaded (or whose reload was rejected) would otherwise be overwritten
    without anyone seeing the edit."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ApiError(500, f"{path}: cannot read the config file: {exc.strerror or exc}",
                       code="config_unreadable", type_="server_error") from None
    try:
        on_disk = yaml.safe_load(data) or {}
    except yaml.YAMLError:
        on_disk = None
    if on_disk != running:
        raise ApiError(409, f"{path} differs from the running config (edited and not reloaded, or its "
                            "reload was rejected); reload it (gridctl reload) or fix it, then retry",
                       code="config_changed_on_disk")
    return data


def write_config(path: pathlib.Path, data: bytes) -> None:
    """write_durably with the file's permission bits kept, so a config holding a literal
    api_key is never rewritten under the umask's wider bits."""
    try:
        mode = os.stat(path).st_mode & 0o7777
    except OSError:
        mode = 0o600
    write_durably(path, data, mode=mode)

