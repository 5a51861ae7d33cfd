"""What a training loop hands the client, checked: the Session's limits (a bad one raises, before
training starts), report fields and hints (a bad one is left out with one warning: the loop must
not die of it, and the daemon would refuse it).
"""
from __future__ import annotations

import logging
import operator
from typing import Any, Dict, Optional, Set

from . import protocol

MAX_HINTS = 32

log = logging.getLogger("memd.client")


def optional_count(value: Any, name: str) -> Optional[int]:
    return None if value is None else count(value, name)


def count(value: Any, name: str, allow_zero: bool = False) -> int:
    try:
        number = operator.index(value) if not isinstance(value, float) else int(value)
    except TypeError:
        raise TypeError("%s must be an integer, not %r" % (name, value)) from None
    except (ValueError, OverflowError):  # a NaN or an infinity
        raise ValueError("%s must be a finite count, not %r" % (name, value)) from None
    if isinstance(value, bool) or number < (0 if allow_zero else 1):
        raise ValueError("%s must be %s, not %r" % (name, "a count >= 0" if allow_zero else "a count >= 1", value))
    high = protocol.FIELD_RANGES.get(name, (0, number))[1]  # the daemon would refuse more (docs/protocol.md)
    if number > high:
        raise ValueError("%s must be at most %d, not %d" % (name, high, number))
    return number


def wire_number(value: Any, name: str, call: str, warned: Set[object]) -> Any:
    """``value`` as the protocol's field ``name`` takes it (an int; a float for step_seconds),
    or None, with a warning once per ``warned`` set, when it is not a finite number in the field's
    range: the training loop that handed it over must not die of it, and the daemon would
    refuse it."""
    low, high = protocol.FIELD_RANGES[name]
    try:
        if isinstance(value, (bool, str, bytes)):
            raise TypeError
        if name == "step_seconds":
            number = float(value)
        elif isinstance(value, float):
            number = int(value)  # NaN: ValueError; an infinity: OverflowError
        else:
            number = operator.index(value)
        if not low <= number <= high:  # False for NaN too
            raise ValueError
    except (TypeError, ValueError, OverflowError):
        warn_once(warned, (call, name), "memd: %s(%s=%.60r) left out: not a number in [%d, %d]",
                  call, name, value, low, high)
        return None
    return number


def warn_once(warned: Set[object], key: Any, message: str, *args: Any) -> None:
    if key not in warned and len(warned) < 1024:
        warned.add(key)
        log.warning(message, *args)


def clean_hints(hints: Optional[Dict[str, Any]], warned: Set[object]) -> Dict[str, Any]:
    """Keep hints small and plain (str keys, scalar values) so they always fit the wire, and
    within protocol.HINT_RANGES: the daemon would ignore the rest anyway."""
    if not hints:
        return {}
    if not isinstance(hints, dict):
        raise TypeError("hints must be a dict, not %r" % (type(hints).__name__,))
    clean: Dict[str, Any] = {}
    for key, value in list(hints.items())[:MAX_HINTS]:
        if isinstance(value, (bool, int, float, str)) or value is None:
            key = str(key)[:64]
            problem = protocol.hint_problem(key, value)
            if problem is not None:
                warn_once(warned, ("hints", key), "memd: %s; not sent", problem)
                continue
            clean[key] = value[:256] if isinstance(value, str) else value
    return clean
