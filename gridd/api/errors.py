"""The providers API's error answer (DESIGN 5)."""

from __future__ import annotations

__all__ = ["ApiError"]


class ApiError(Exception):
    """One error answer: ``{"error": {"message", "type", "param", "code"}}`` (DESIGN 5)."""

    def __init__(self, status: int, message: str, *, code: str, param: str | None = None,
                 type_: str = "invalid_request_error",
                 headers: list[tuple[bytes, bytes]] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type_
        self.headers = headers or []

