"""Errors a user can fix, and the checks that raise them with the field's name and what is allowed."""
from __future__ import annotations


class InputError(ValueError):
    """A setting or input the user can fix; the command-line apps print its message as one line and
    exit 2 (any other exception keeps its traceback)."""


def check_choice(field: str, value, allowed) -> None:
    """``field=value`` must be one of ``allowed``; the error lists them."""
    if value not in allowed:
        raise InputError(f"{field}={value!r} is not allowed; choose one of {', '.join(map(str, allowed))}")


def check_number(field: str, value, minimum: float, maximum: float | None = None, meaning: str = "") -> float:
    """``field`` must be a number in ``[minimum, maximum]``; returns it as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum or \
            (maximum is not None and value > maximum):
        allowed = f"in [{minimum:g}, {maximum:g}]" if maximum is not None else f">= {minimum:g}"
        raise InputError(f"{field}={value!r} must be a number {allowed}" + (f": {meaning}" if meaning else ""))
    return float(value)


def check_bool(field: str, value) -> None:
    if not isinstance(value, bool):
        raise InputError(f"{field}={value!r} must be true or false")


def check_int(field: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InputError(f"{field}={value!r} must be an integer >= {minimum}")
