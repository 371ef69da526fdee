"""Which version of a turn is read: the one rule every reader of stored turns applies.

A turn (tenant, conversation, turn index) may be stored in several versions (a late
span re-classified it) and by several holders (the classifiers of a sharded tier, or
their stores read as one, when a conversation was re-routed between them). Its highest
version wins, a tie going to the later entry. A turn whose winning version is a
retirement (lineage moved it under another key: ``superseded``) is not read at all,
whoever holds its older versions. A conversation is held by whoever holds the winning
version of its last turn read: the place its spans went on to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, Iterable, TypeVar

H = TypeVar("H")
TurnKey = tuple[Any, Any, Any]  # (tenant, conversation id, turn index)


@dataclass(frozen=True)
class Entry(Generic[H]):
    key: TurnKey
    version: int
    retired: bool
    turn: dict[str, Any] | None  # None for a retirement
    holder: H


def winners(entries: Iterable[Entry[H]]) -> list[Entry[H]]:
    """Each turn's winning entry, retirements included, in key order."""
    best: dict[TurnKey, Entry[H]] = {}
    for entry in entries:
        held = best.get(entry.key)
        if held is None or entry.version >= held.version:
            best[entry.key] = entry
    return [best[key] for key in sorted(best, key=lambda k: (str(k[0]), str(k[1]), k[2] or 0))]


def latest(entries: Iterable[Entry[H]]) -> tuple[list[Entry[H]], dict[str, H]]:
    """The winning entries of the turns read, in key order, and per conversation id
    its holder."""
    kept = [entry for entry in winners(entries) if not entry.retired]
    holders: dict[str, H] = {}
    last: dict[str, tuple[int, int]] = {}
    for entry in kept:
        rank = (entry.key[2] or 0, entry.version)
        conversation = str(entry.key[1])
        if rank >= last.get(conversation, (-1, -1)):
            last[conversation] = rank
            holders[conversation] = entry.holder
    return kept, holders


def answer_entries(holder: H, turns: Iterable[dict], retired: Iterable[dict] = ()):
    """Entries of a classifier's answer (``GET /conversations/ID``): its turns, and
    with ``?local=1`` the keys it retired (what a peer's answer hides)."""
    for turn in turns:
        yield Entry(_key(turn), int(turn.get("version") or 0), False, turn, holder)
    for key in retired:
        yield Entry(_key(key), int(key.get("version") or 0), True, None, holder)


def _key(turn: dict) -> TurnKey:
    return (turn.get("tenant"), turn.get("conversation_id"), turn.get("turn"))
