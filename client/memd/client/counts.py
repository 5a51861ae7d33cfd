"""The one rule for whole numbers, shared by both ends and every layer (the wire, hints, state
files, the estimators): a value is a whole number when it is an ``int`` and not a ``bool`` (True
is an int to Python, and a count to nobody). Plain Python, so the pure policy imports it too.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from typing import TypeGuard  # Python 3.10; the client runs on 3.9, where this is never read


def whole(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def at_least(value: object, low: int) -> Optional[int]:
    """``value`` when it is a whole number >= ``low``, else None (a hint that cannot be used)."""
    return value if whole(value) and value >= low else None
