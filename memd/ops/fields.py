"""A request's fields, checked: each within its protocol.FIELD_RANGES range (no number a client
sends may drive a loop or an allocation unbounded), else Invalid naming the field."""
from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Pattern, Tuple, overload

from memd.client import protocol
from memd.client.counts import whole


class Invalid(ValueError):
    """A request field is missing, of the wrong type, or out of range."""


@overload
def integer(req: Dict[str, Any], name: str, required: Literal[True]) -> int: ...
@overload
def integer(req: Dict[str, Any], name: str, *, default: int) -> int: ...
@overload
def integer(req: Dict[str, Any], name: str) -> Optional[int]: ...


def integer(req: Dict[str, Any], name: str, required: bool = False, default: Optional[int] = None) -> Optional[int]:
    """An integer field within its range; ``default`` when absent (or null) and not required."""
    value = req.get(name)
    if value is None:
        if required:
            raise Invalid("%s is required" % name)
        return default
    if not whole(value):
        raise Invalid("%s must be an integer, not %s" % (name, type(value).__name__))
    low, high = protocol.FIELD_RANGES[name]
    if not low <= value <= high:
        raise Invalid("%s must be an integer in [%d, %d], got %d" % (name, low, high, value))
    return value


def number(req: Dict[str, Any], name: str) -> Optional[float]:
    """A number field within its range; NaN and infinities are refused."""
    value = req.get(name)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise Invalid("%s must be a number, not %s" % (name, type(value).__name__))
    low, high = protocol.FIELD_RANGES[name]
    if not low <= value <= high:
        raise Invalid("%s must be a finite number in [%g, %g], got %r" % (name, low, high, value))
    return float(value)


@overload
def text(req: Dict[str, Any], name: str, required: Literal[True], limit: int = 256) -> str: ...
@overload
def text(req: Dict[str, Any], name: str, *, limit: int = 256) -> Optional[str]: ...


def text(req: Dict[str, Any], name: str, required: bool = False, limit: int = 256) -> Optional[str]:
    """A string field of at most ``limit`` characters."""
    value = req.get(name)
    if value is None:
        if required:
            raise Invalid("%s is required" % name)
        return None
    if not isinstance(value, str) or len(value) > limit:
        raise Invalid("%s must be a string of at most %d characters" % (name, limit))
    return value


def matching(req: Dict[str, Any], name: str, pattern: Pattern[str]) -> Optional[str]:
    """A string field that must match ``pattern`` (an identifier: nothing else gets into a label)."""
    value = text(req, name, limit=64)
    if value is not None and not pattern.match(value):
        raise Invalid("%s %r is not a valid %s" % (name, value[:64], name.replace("_", " ")))
    return value


def hints(req: Dict[str, Any]) -> Tuple[Dict[str, Any], List[str]]:
    """The hints map within protocol.HINT_RANGES, and why each other one was dropped: estimators
    cost in proportion to a model's size, so a hint beyond any real model is ignored, not used
    (the job is planned as if it had not given it; an error would leave it with no plan). Not a
    map of at most 64 scalars: Invalid."""
    given = req.get("hints") or {}
    if not isinstance(given, dict) or len(given) > 64 or not all(
            isinstance(k, str) and (v is None or isinstance(v, (bool, int, float, str))) for k, v in given.items()):
        raise Invalid("hints must be a map of at most 64 scalars")
    kept, ignored = {}, []
    for name, value in given.items():
        problem = protocol.hint_problem(name, value)
        if problem is None:
            kept[name] = value
        else:
            ignored.append(problem)
    return kept, ignored
