"""Errors a user can fix, and the checks that raise them with the field's name and what is allowed."""
from __future__ import annotations


class InputError(ValueError):
    """A setting or input the user can fix; the command-line apps print its message as one line and
    exit 2 (any other exception keeps its traceback)."""


def check_choice(field: str, value, allowed) -> None:
    """``field=value`` must be one of ``allowed``; the error lists them."""
    if value not in allowed:
        raise InputError(f"{field}={value!r} is not allowed; choose one of {', '.join(map(str, allowed))}")


def check_int(field: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InputError(f"{field}={value!r} must be an integer >= {minimum}")
