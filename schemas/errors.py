"""One base for every error a caller of FreshRec can see: ``FreshRecError``.

Each error keeps its natural built-in base too (a bad setting is a ``ValueError``, a timeout a
``TimeoutError``), so code that caught those goes on working; code that wants "anything
FreshRec raised" catches ``FreshRecError``. ``retriable`` says whether the same call may
succeed if made again unchanged (a timeout, a broker that did not answer), as aiokafka's
errors do: retry loops ask it instead of listing types.
"""

from __future__ import annotations


class FreshRecError(Exception):
    """Anything FreshRec raises on purpose."""

    retriable: bool = False
    """The same call may succeed if made again unchanged."""


class RetriableError(FreshRecError):
    """A FreshRec error that a later attempt may not meet (an outage, a timeout)."""

    retriable = True
