"""Helpers shared by the frozen config dataclasses that live next to their owners.

Config precedence is defaults < config file < command-line flags; environment variables never
take part. :func:`from_mapping` builds a dataclass from a (config-file) mapping and rejects
unknown keys with a message that lists the known ones.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def from_mapping(cls: type[T], values: Mapping[str, Any]) -> T:
    """Build the frozen dataclass ``cls`` from ``values``; unknown keys are a ``ValueError``."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(
            f"unknown {cls.__name__} option(s): {', '.join(unknown)}; "
            f"known options: {', '.join(sorted(known))}"
        )
    return cls(**dict(values))


def to_mapping(config: Any) -> dict[str, Any]:
    """The inverse of :func:`from_mapping`: a plain dict of the dataclass fields."""
    return dataclasses.asdict(config)


def require(condition: bool, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``condition`` holds (for ``__post_init__``)."""
    if not condition:
        raise ValueError(message)


def require_positive(name: str, value: float) -> None:
    require(
        isinstance(value, (int, float)) and math.isfinite(value) and value > 0,
        f"{name} must be a positive number, got {value!r}",
    )


def require_non_negative(name: str, value: float) -> None:
    require(
        isinstance(value, (int, float)) and math.isfinite(value) and value >= 0,
        f"{name} must be a non-negative number, got {value!r}",
    )


def require_int(name: str, value: object, *, minimum: int) -> None:
    require(
        isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
        f"{name} must be an integer >= {minimum}, got {value!r}",
    )


def require_fraction(name: str, value: float, *, closed_high: bool = True) -> None:
    ok = (
        isinstance(value, (int, float))
        and value >= 0.0
        and (value <= 1.0 if closed_high else value < 1.0)
    )
    bound = "[0, 1]" if closed_high else "[0, 1)"
    require(ok, f"{name} must be in {bound}, got {value!r}")
