"""Checks shared by the option modules (``server_args``, ``scale_out_options``,
``scheduling_options``): each raises ``ValueError`` naming the option."""

from __future__ import annotations


def check_positive(name: str, value: int) -> None:
    """``value`` must be an int >= 1 (a bool is not one)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
