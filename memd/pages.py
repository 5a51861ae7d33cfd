"""Replies too long for one message, in pages: `curves` (memd.curves) and `status` (its sessions).

A reply must stay within the protocol's MAX_MESSAGE_BYTES (the client's decoder is sized for
it), while what it lists may not (512 curves are up to 1.4 MB; 255 sessions a 187 KB status).
So a page holds the entries after a cursor while they fit in PAGE_BYTES of msgpack, at most
``limit`` of them, and always at least one, so that paging ends; the reply's ``next`` is the
cursor of the page after. A cursor names the last entry shown, not an offset: an entry added
or dropped between two pages moves no other one.
Pure functions: no core, no I/O.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional

from memd.client import protocol

PAGE_BYTES = protocol.MAX_MESSAGE_BYTES // 2
MAX_LIMIT = protocol.FIELD_RANGES["limit"][1]


def fill(entries: Iterable[Dict[str, Any]], budget: int = PAGE_BYTES,
         limit: Optional[int] = None) -> List[Dict[str, Any]]:
    """The first of ``entries`` that fit in ``budget`` bytes of msgpack, at most ``limit`` of
    them; at least one when there is one. Entries past the page are never built (a generator)."""
    shown: List[Dict[str, Any]] = []
    used = 0
    for entry in entries:
        if shown and limit is not None and len(shown) >= limit:
            break
        size = len(protocol.encode(entry))
        if shown and used + size > budget:
            break
        shown.append(entry)
        used += size
    return shown
