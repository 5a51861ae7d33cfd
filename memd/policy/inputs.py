"""The estimators' inputs, checked: one error type whose message names the input."""
from __future__ import annotations

import math
from typing import Any, Mapping


class EstimateError(ValueError):
    """Bad input to an estimator; the message names the input."""


def rounded(value: float) -> float:
    return round(value, 6)


def number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise EstimateError("%s must be a number: %r" % (name, value))
    return float(value)


def positive(name: str, value: Any) -> None:
    if number(name, value) <= 0:
        raise EstimateError("%s must be positive: %r" % (name, value))


def non_negative(name: str, value: Any) -> None:
    if number(name, value) < 0:
        raise EstimateError("%s must not be negative: %r" % (name, value))


def choice(name: str, value: Any, table: Mapping[str, Any]) -> Any:
    key = str(value).lower().replace("_", "-").replace(" ", "-")
    if key not in table:
        raise EstimateError("unknown %s %r (one of %s)" % (name, value, ", ".join(table)))
    return table[key]
