"""The one reading of Pensieve's on/off environment variables (``PENSIEVE_*=0|1``)."""

from __future__ import annotations

import os

FLAG_VALUES = {"": False, "0": False, "1": True}
"""What an on/off environment variable may be set to (unset or empty: its default)."""


def env_flag(name: str, default: bool = False) -> bool:
    """The on/off environment variable ``name``: ``0`` is off, ``1`` on, unset or empty
    ``default``; anything else is a ValueError that names it (a typo must not silently mean
    either)."""
    value = os.environ.get(name, "").strip()
    if value not in FLAG_VALUES:
        raise ValueError(f"{name}={value!r}: expected 0 or 1")
    return default if not value else FLAG_VALUES[value]
