"""What memd remembers, as the `curves` op shows it: one entry per job and pool, in pages.

The Store is bounded (state.MAX_JOBS entries of at most state.MAX_POINTS points, keys of at
most state.MAX_KEY_CHARS characters), but not to one message: 512 entries of 32 points with
long names are up to 1.4 MB of msgpack (twice that with the CURVE keys' own), and a reply
must stay within the protocol's MAX_MESSAGE_BYTES (the client's decoder is sized for it). So a
reply carries the entries in (job, pool) order up to PAGE_BYTES of them (memd.pages), and a
cursor (``next``: the last one's job and pool) to ask for the rest with. One entry is at most
ENTRY_BYTES (its key, 512 characters, is at most 2 KiB of UTF-8; 32 points of two integers
below 2**63 are 19 bytes each; the ceiling and the time 9 each; the clean runs 3; the owner 46,
a CURVE key's; the field names 52), a page stops before PAGE_BYTES, and the cursor is at most
one more key: a reply is under PAGE_BYTES + 2 * ENTRY_BYTES, well within MAX_MESSAGE_BYTES.
Pure functions: no core, no I/O.
"""
from __future__ import annotations

import bisect
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from memd import pages
from memd.state import Memory, owner_of

PAGE_BYTES = pages.PAGE_BYTES
ENTRY_BYTES = 3 * 1024  # the most one entry can take (above); tests check it

Recall = Callable[[str, str], Optional[Memory]]  # Store.recall


def view(job: str, pool: str, memory: Memory) -> Dict[str, Any]:
    """One remembered curve as the wire (and `memd curves --json`) shows it."""
    return {
        "job": job,
        "pool": pool,
        "points": [[o.batch, o.peak_bytes] for o in memory.observations],
        "owner": owner_of(pool),
        "ceiling": memory.ceiling,
        "ceiling_cause": memory.cause if memory.ceiling is not None else None,
        "clean_runs": memory.clean_runs,
        "updated": int(memory.updated),
    }


def page(keys: Sequence[Tuple[str, str]], recall: Recall, after: Optional[Sequence[str]] = None,
         budget: int = PAGE_BYTES, limit: Optional[int] = None) -> Dict[str, Any]:
    """The entries after the cursor ``after`` (``keys`` sorted by job and pool, as Store.keys
    gives them; ``recall`` is Store.recall) that fit in ``budget`` bytes of msgpack (at most
    ``limit`` of them), and the cursor of the next page (None on the last). A page holds at
    least one entry, so paging always ends (memd.pages)."""
    start = 0 if after is None else bisect.bisect_right(keys, tuple(after))
    shown = pages.fill((_viewed(job, pool, recall) for job, pool in keys[start:]), budget, limit)
    more = start + len(shown) < len(keys)
    return {"curves": shown, "total": len(keys), "next": [shown[-1]["job"], shown[-1]["pool"]] if more else None}


def _viewed(job: str, pool: str, recall: Recall) -> Dict[str, Any]:
    memory = recall(job, pool)
    assert memory is not None, "Store.keys() gave %r, Store.recall() did not find it" % ((job, pool),)
    return view(job, pool, memory)
