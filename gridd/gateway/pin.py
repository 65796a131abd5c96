"""The header that pins a request to the site it was forwarded to (docs/front.md, "Pin")."""

from __future__ import annotations

from typing import Final

__all__ = ["PIN_HEADER"]

PIN_HEADER: Final = "x-gridd-site"
"""A request forwarded to another site's ingress carries this header naming that site; the
receiving gateway serves it locally and never re-routes it (no loops)."""
