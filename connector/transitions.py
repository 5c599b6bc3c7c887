"""The one check every phase change goes through: a table of allowed transitions per state
machine (rooms on both sides, the language worker's requests, the engine's generations)."""

from __future__ import annotations

import enum
from collections.abc import Mapping


def checked_move(table: Mapping[enum.Enum, frozenset], current: enum.Enum, new: enum.Enum, owner: str) -> enum.Enum:
    """``new`` when ``table`` allows ``current -> new``; an AssertionError naming ``owner`` (a
    bug: the caller moved a phase its table does not allow) otherwise."""
    if new not in table[current]:
        raise AssertionError(f"{owner}: no transition {current.name} -> {new.name}")
    return new
