"""Edits of the raw config tree the providers API makes (the tree is never modified in place),
and the YAML it writes back. A POST replaces each top-level field it gives (DESIGN 5b)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import yaml

from gridd.api.errors import ApiError

__all__ = ["delete_provider", "find_provider", "provider_not_found", "render_config", "upsert_provider"]


def _providers(tree: dict[str, Any]) -> list[Any]:
    providers = tree.get("providers")
    if providers is None:
        providers = tree["providers"] = []
    return providers


def find_provider(raw: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    for provider in raw.get("providers") or []:
        if isinstance(provider, dict) and provider.get("name") == name:
            return provider
    return None


def upsert_provider(raw: Mapping[str, Any], name: str,
                    fields: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any], bool]:
    """(new tree, the provider as it will be written, created?). DESIGN 5b: each top-level
    field in ``fields`` replaces the stored one whole (``settings`` included); absent fields
    are kept. A ``name`` in the body must be the path's."""
    if "name" in fields and fields["name"] != name:
        raise ApiError(400, f"the body names provider {fields['name']!r} but the path names {name!r}; "
                            "omit `name` or make them match", code="name_mismatch", param="name")
    given = {k: v for k, v in fields.items() if k != "name"}
    tree = copy.deepcopy(dict(raw))
    providers = _providers(tree)
    for i, provider in enumerate(providers):
        if isinstance(provider, dict) and provider.get("name") == name:
            providers[i] = {**provider, **given}  # stored order kept; new fields go last
            return tree, providers[i], False
    created = {"name": name, **given}
    providers.append(created)
    return tree, created, True


def delete_provider(raw: Mapping[str, Any], name: str) -> dict[str, Any]:
    tree = copy.deepcopy(dict(raw))
    providers = _providers(tree)
    kept = [p for p in providers if not (isinstance(p, dict) and p.get("name") == name)]
    if len(kept) == len(providers):
        raise provider_not_found(name)
    tree["providers"] = kept
    return tree


def render_config(tree: Mapping[str, Any]) -> str:
    """The YAML written back: keys in their order, placeholders as written. Comments and
    layout of the original file are not kept (docs/providers-api.md)."""
    return yaml.safe_dump(dict(tree), sort_keys=False, allow_unicode=True, default_flow_style=False,
                          width=100)


def provider_not_found(name: str) -> ApiError:
    return ApiError(404, f"no provider named {name!r}", code="provider_not_found", param="name")

