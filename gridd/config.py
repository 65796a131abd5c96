"""gridd's configuration file: one YAML file decoded into the Structs of gridd.config_schema.

Loading is pure apart from reading the file and the environment: ``load_config`` returns a
``LoadedConfig`` or raises ``ConfigError`` whose message names the exact path of the bad
value and what was expected, e.g. ``providers[2].probes[0].interval: expected a number > 0,
got -1``. ``${VAR}`` placeholders resolve from the environment at load time; the raw tree
(placeholders as written) is kept so the providers API can rewrite the file faithfully.
Rules spanning several keys are gridd.config_rules'; every knob is documented in
docs/config.md.
"""

from __future__ import annotations

import os
import pathlib
import re
import time
from collections.abc import Mapping
from typing import Any, TypedDict

import msgspec
import msgspec.inspect
import yaml

from gridd.config_rules import check_config_rules
from gridd.config_schema import Config
from gridd.errors import ConfigError


class LoadedConfig(msgspec.Struct, frozen=True, kw_only=True):
    config: Config
    raw: dict[str, Any]
    """The YAML tree as written, ``${VAR}`` placeholders unresolved."""
    path: pathlib.Path
    workspace: pathlib.Path
    loaded_at: float
    """Wall-clock time of the load."""

    def resolve(self, path: str) -> pathlib.Path:
        """A config-relative path resolves against the workspace, not the process CWD."""
        p = pathlib.Path(os.path.expanduser(path))
        return p if p.is_absolute() else self.workspace / p


# -- loading ----------------------------------------------------------------------------------

def placeholder_names(node: Any) -> set[str]:
    """Every ``${VAR}`` name used anywhere in a raw config tree."""
    if isinstance(node, str):
        return {m.group(1) for m in _PLACEHOLDER.finditer(node)}
    if isinstance(node, dict):
        return set().union(*(placeholder_names(v) for v in node.values())) if node else set()
    if isinstance(node, list):
        return set().union(*(placeholder_names(v) for v in node)) if node else set()
    return set()


_PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
"""``${VAR}`` (required) or ``${VAR:-default}`` (default when VAR is unset)."""


def _fmt_path(parts: list[str | int]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out or "(top level)"


def _substitute(node: Any, env: dict[str, str], parts: list[str | int]) -> Any:
    if isinstance(node, str):

        def repl(m: re.Match[str]) -> str:
            name, default = m.group(1), m.group(2)
            if name not in env:
                if default is not None:
                    return default
                raise ConfigError(
                    f"{_fmt_path(parts)}: environment variable {name} is not set (used as ${{{name}}})"
                )
            return env[name]

        return _PLACEHOLDER.sub(repl, node)
    if isinstance(node, dict):
        return {k: _substitute(v, env, [*parts, str(k)]) for k, v in node.items()}
    if isinstance(node, list):
        return [_substitute(v, env, [*parts, i]) for i, v in enumerate(node)]
    return node


_AT = re.compile(r"^(?P<what>.*?) - at `\$(?P<path>[^`]*)`$", re.S)
_PATH_PART = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]|\[\"?([^\]\"]*)\"?\]")


def _split_msgspec_path(path: str) -> list[str | int]:
    parts: list[str | int] = []
    for m in _PATH_PART.finditer(path):
        if m.group(1) is not None:
            parts.append(m.group(1))
        elif m.group(2) is not None:
            parts.append(int(m.group(2)))
        else:
            parts.append(m.group(3))
    return parts


def _lookup(tree: Any, parts: list[str | int]) -> tuple[bool, Any]:
    node = tree
    for part in parts:
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            return False, None
    return True, node


def _friendly(what: str) -> str:
    """msgspec's ``Expected `float` > 0`` -> ``expected a number > 0``."""
    what = what.replace("`float`", "a number").replace("`int`", "an integer")
    what = what.replace("`str`", "a string").replace("`bool`", "true or false")
    what = what.replace("`object`", "a mapping").replace("`array`", "a list").replace("`null`", "null")
    what = what.replace("`", "'")
    what = re.sub(r"\b(\d+)\.0\b", r"\1", what)
    return what[:1].lower() + what[1:]


def _allowed_values(parts: list[str | int]) -> list[Any]:
    """The Literal choices at a path of Config, for a readable 'expected one of' message."""
    info: Any = msgspec.inspect.type_info(Config)
    for part in [*parts, None]:
        while True:
            if isinstance(info, msgspec.inspect.Metadata):
                info = info.type
            elif isinstance(info, msgspec.inspect.UnionType):
                info = next(t for t in info.types if not isinstance(t, msgspec.inspect.NoneType))
            else:
                break
        if part is None:
            break
        if isinstance(info, msgspec.inspect.StructType):
            info = next(f.type for f in info.fields if f.name == part)
        elif isinstance(info, msgspec.inspect.ListType | msgspec.inspect.DictType):
            info = info.item_type if isinstance(info, msgspec.inspect.ListType) else info.value_type
    return list(getattr(info, "values", ()))


def _explain(err: msgspec.ValidationError, tree: Any) -> str:
    text = str(err)
    m = _AT.match(text)
    parts = _split_msgspec_path(m.group("path")) if m else []
    what = m.group("what") if m else text
    if what.startswith("Object contains unknown field"):
        field = what.split("`")[1]
        return f"{_fmt_path([*parts, field])}: unknown field (check spelling; see docs/config.md)"
    if what.startswith("Object missing required field"):
        field = what.split("`")[1]
        return f"{_fmt_path([*parts, field])}: required field is missing"
    found, value = _lookup(tree, parts)
    if what.startswith("Invalid enum value"):
        allowed = _allowed_values(parts)
        return f"{_fmt_path(parts)}: expected one of {', '.join(map(repr, allowed))}, got {value!r}"
    got = ""
    if found:
        # Show the offending value itself where it is a scalar; a mapping or list by its kind.
        what = what.split(", got `")[0]
        got = f", got a {type(value).__name__}" if isinstance(value, dict | list) else f", got {value!r}"
    return f"{_fmt_path(parts)}: {_friendly(what)}{got}"


def parse_config(
    text: str, *, env: dict[str, str] | None = None, source: str = "<config>"
) -> tuple[Config, dict[str, Any]]:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{source}: not valid YAML{where}: {problem}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"(top level): expected a mapping, got a {type(raw).__name__}")
    resolved = _substitute(raw, dict(os.environ) if env is None else env, [])
    try:
        cfg = msgspec.convert(resolved, Config)
    except msgspec.ValidationError as exc:
        # The offending value is shown as written (placeholders unresolved): an error message
        # must never echo a value taken from the environment, which may be a secret.
        raise ConfigError(_explain(exc, raw)) from None
    check_config_rules(cfg)
    return cfg, raw


def load_config(path: str | os.PathLike[str], *, env: dict[str, str] | None = None) -> LoadedConfig:
    p = pathlib.Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read config: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: config is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    environ = dict(os.environ) if env is None else env
    try:
        cfg, raw = parse_config(text, env=environ, source=str(p))
    except ConfigError as exc:
        message = str(exc)
        raise ConfigError(message if message.startswith(f"{p}:") else f"{p}: {message}") from None
    named = workspace_from_env(environ)
    workspace = pathlib.Path(named) if named else p.resolve().parent
    return LoadedConfig(config=cfg, raw=raw, path=p.resolve(), workspace=workspace, loaded_at=time.time())


CONFIG_ENV = ("GRIDD_CONFIG", "GATEWAY_CONFIG")
"""Where the config file is named when no argument names it; the first set wins. The
second is spec 004's name (its examples use ``$GATEWAY_CONFIG``)."""
WORKSPACE_ENV = ("GRIDD_WORKSPACE", "GATEWAY_WORKSPACE")
"""The workspace (relative paths resolve against it), else the config file's directory;
the first set wins. The second is spec 004's name."""


def config_from_env(environ: Mapping[str, str]) -> str | None:
    return next((environ[name] for name in CONFIG_ENV if environ.get(name)), None)


def workspace_from_env(environ: Mapping[str, str]) -> str | None:
    return next((environ[name] for name in WORKSPACE_ENV if environ.get(name)), None)


def default_control_socket(
    cfg: Config | None, workspace: pathlib.Path | None, env: dict[str, str]
) -> pathlib.Path:
    """The control socket: config, else $RUNTIME_DIRECTORY (systemd), else /run/gridd."""
    if cfg is not None and cfg.control_socket:
        p = pathlib.Path(cfg.control_socket)
        return p if p.is_absolute() or workspace is None else workspace / p
    runtime = env.get("RUNTIME_DIRECTORY", "").split(":")[0]
    return pathlib.Path(runtime or "/run/gridd") / "gridd.sock"


class HttpLimits(TypedDict):
    """serve_asgi's keyword arguments for the bounds of ``limits``."""

    max_connections: int
    body_deadline_s: float
    max_buffered_bytes: int


def http_limits(cfg: Config) -> HttpLimits:
    """serve_asgi's keyword arguments for the bounds of ``limits`` (docs/security.md)."""
    lim = cfg.limits
    return {"max_connections": lim.http_max_connections, "body_deadline_s": lim.http_body_deadline_s,
            "max_buffered_bytes": lim.http_max_buffered_bytes}


def diff(old: Config, new: Config) -> set[str]:
    """Top-level sections that changed, so a reload restarts only what it must."""
    return {f for f in old.__struct_fields__ if getattr(old, f) != getattr(new, f)}
