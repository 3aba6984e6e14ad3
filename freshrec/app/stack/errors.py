"""The one error the embedded stack raises on purpose."""

from __future__ import annotations

from schemas.errors import FreshRecError


class StackError(FreshRecError, RuntimeError):
    """A one-line, user-facing reason the stack could not start or stop."""
