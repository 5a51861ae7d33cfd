"""What memd learned, kept across restarts: each job's memory curve per kind of pool.

One JSON file under the state directory, replaced atomically (write, fsync, rename), so a
crash or power loss leaves either the old file or the new one. A corrupt file is moved aside
and memd starts empty rather than not at all. Bounded: the least recently used jobs go first.
"""
from __future__ import annotations

import collections
import concurrent.futures
import json
import math
import os
import re
import stat
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import structlog

from memd.client.counts import whole
from memd.policy.fit import Observation
from memd.sessions import OWNER

FILE = "curves.json"
VERSION = 1
MAX_JOBS = 512
MAX_POINTS = 32
MAX_KEY_CHARS = 512  # "job|pool": a job name (128) and a pool key the daemon made; bounds a `curves` entry
MAX_INT = 2 ** 63 - 1  # what msgpack carries: a hand-edited file's 10**30 would fail every reply that shows it
TEMP_PREFIX = ".curves."
_TEMP = re.compile(r"\.curves\.[a-z0-9_]{8}\Z")  # what tempfile.mkstemp(prefix=TEMP_PREFIX) names

log = structlog.get_logger("memd.state")


@dataclass(frozen=True)
class Memory:
    observations: Tuple[Observation, ...]
    ceiling: Optional[int]
    updated: float
    clean_runs: int = 0  # runs since the ceiling that went clean at it (sessions.SessionRecord.learned)


class StateStore:
    def __init__(self, directory: str, max_jobs: int = MAX_JOBS):
        self.directory = directory
        self.max_jobs = max_jobs
        self.path = os.path.join(directory, FILE)
        self._jobs: Dict[str, dict] = {}
        self.dirty = False
        # Writes in order: each carries the generation it was taken at, and one older than the
        # file's is skipped, so a late background write never brings back what a forget dropped.
        self._write_lock = threading.Lock()
        self._generation = self._written = 0
        self._writer: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._pending: Optional[Tuple[str, int]] = None  # the newest state not yet handed to a write
        self._pending_lock = threading.Lock()

    def load(self) -> None:
        try:
            with open(self.path) as f:
                data = json.load(f)
            if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("jobs"), dict):
                raise ValueError("unexpected layout")
            self._jobs = {k: v for k, v in data["jobs"].items() if _valid(k, v)}
        except FileNotFoundError:
            self._jobs = {}
        except (OSError, ValueError) as exc:
            aside = self.path + ".corrupt"
            log.warning("state_unreadable", path=self.path, error=str(exc), moved_to=aside,
                        kept="nothing: starting empty")
            try:
                os.replace(self.path, aside)
            except OSError:
                pass
            self._jobs = {}

    def remove_stale_temps(self, before: float) -> int:
        """Remove the temp files of writes that never finished (a kill -9 or a power cut between
        mkstemp and rename leaves one, and nothing else would ever remove it): only regular
        files named as flush() names them, in this directory, last written before ``before``
        (the daemon's start, so a write in progress now is never touched). Returns how many."""
        removed = 0
        try:
            names = os.listdir(self.directory)
        except OSError:
            return 0
        for name in names:
            if not _TEMP.match(name):
                continue
            path = os.path.join(self.directory, name)
            try:
                st = os.lstat(path)
                if stat.S_ISREG(st.st_mode) and st.st_mtime < before:
                    os.unlink(path)
                    removed += 1
            except OSError as exc:
                log.warning("state_temp_not_removed", path=path, error=str(exc))
        if removed:
            log.info("state_temps_removed", directory=self.directory, count=removed)
        return removed

    def recall(self, job: str, pool_key: str) -> Optional[Memory]:
        entry = self._jobs.get(_key(job, pool_key))
        return None if entry is None else _memory(entry)

    def keys(self) -> List[Tuple[str, str]]:
        """What is remembered, as (job, pool key) sorted by job then pool: an order that does
        not move when a job is used (the LRU order does), so `curves` can page through it with
        a cursor, and recall() only the page's entries (all 512 of 32 points cost 13 ms)."""
        return sorted(_split(key) for key in self._jobs)

    def forget(self, job: str, pool_key: Optional[str] = None) -> List[str]:
        """Drop what was learned for ``job``, in every pool or only ``pool_key`` (a pool key
        without its configuration and owner, planner.identify's "#..." and "@uid:...", names every
        configuration and owner in that pool); returns the pool keys dropped, sorted. The store is
        dirty (flush writes it) only if one was."""
        dropped = []
        for key in list(self._jobs):
            name, pool = _split(key)
            if name == job and pool_key in (None, pool, base_pool(pool)):
                del self._jobs[key]
                dropped.append(pool)
        if dropped:
            self.dirty = True
        return sorted(dropped)

    def remember(self, job: str, pool_key: str, observations: List[Observation], ceiling: Optional[int],
                 clean_runs: int = 0) -> None:
        points = [[o.batch, o.peak_bytes] for o in observations if o.peak_bytes > 0]
        while len(points) > MAX_POINTS:  # the oldest of the most repeated batch size goes (SessionRecord.observe)
            counts = collections.Counter(b for b, _ in points)
            most = max(counts.values())
            del points[next(i for i, (b, _) in enumerate(points) if counts[b] == most)]
        key = _key(job, pool_key)
        if not points and ceiling is None:  # nothing left to keep (a lifted ceiling was all there was)
            if self._jobs.pop(key, None) is not None:
                self.dirty = True
            return
        if len(key) > MAX_KEY_CHARS:  # cannot happen (a job is 128 characters, NVML's names 96): the bound holds
            log.warning("state_key_too_long", job=job[:128], pool=pool_key[:128])
            return
        self._jobs.pop(key, None)  # re-insert: dict order is the LRU order
        self._jobs[key] = {"points": points, "ceiling": ceiling, "updated": time.time()}
        if ceiling is not None and clean_runs:
            self._jobs[key]["clean"] = clean_runs
        while len(self._jobs) > self.max_jobs:
            del self._jobs[self._evictable()]
        self.dirty = True

    def _evictable(self) -> str:
        """The least recently used key of the owner with the most: a user who fills the store
        (512 junk job names once evicted every curve) evicts their own first."""
        owners = collections.Counter(owner_of(key) for key in self._jobs)
        most = max(owners.values())
        return next(key for key in self._jobs if owners[owner_of(key)] == most)

    def flush(self) -> bool:
        """Write if anything changed, before returning; False (logged, state kept in memory,
        written again at the next flush) when the disk refuses."""
        taken = self._take()
        return True if taken is None else self._write(*taken)

    def flush_soon(self) -> None:
        """flush(), the file written on a thread of its own: the caller pays for the copy (5 ms
        for a full store of 512 curves here), not the write and its fsyncs (33 ms), so the
        daemon can flush every few seconds without stalling its clients. At most one state
        waits (a newer one replaces it), so a disk that stalls holds one copy, not one per flush."""
        taken = self._take()
        if taken is None:
            return
        with self._pending_lock:
            waiting, self._pending = self._pending is not None, taken
        if waiting:
            return  # the write already queued takes this newer state
        if self._writer is None:
            self._writer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="memd-state")
        self._writer.submit(self._write_pending)

    def _write_pending(self) -> None:
        with self._pending_lock:
            taken, self._pending = self._pending, None
        if taken is not None:
            self._write(*taken)

    def close(self) -> None:
        """Wait for a background write to finish (at shutdown, before the last flush)."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None

    def _take(self) -> Optional[Tuple[str, int]]:
        """What the file should hold now, and its generation; None when nothing changed."""
        if not self.dirty:
            return None
        self.dirty = False
        self._generation += 1
        return json.dumps({"version": VERSION, "jobs": self._jobs}, separators=(",", ":")), self._generation

    def _write(self, text: str, generation: int) -> bool:
        with self._write_lock:
            if generation <= self._written:
                return True  # a newer state is on disk already
            try:
                os.makedirs(self.directory, mode=0o750, exist_ok=True)
                fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=self.directory)
                try:
                    with os.fdopen(fd, "w") as f:
                        f.write(text)
                        f.flush()
                        os.fsync(f.fileno())
                    os.replace(tmp, self.path)
                except BaseException:
                    os.unlink(tmp)
                    raise
                dir_fd = os.open(self.directory, os.O_RDONLY)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
            except OSError as exc:
                log.error("state_write_failed", path=self.path, error=str(exc), retry="at the next flush")
                self.dirty = True  # written again at the next flush
                return False
            self._written = generation
            return True

    def __len__(self) -> int:
        return len(self._jobs)


def owner_of(key: str) -> Optional[str]:
    """The owner part of a stored key or pool key ("uid:1000"), None for one without (kept by
    an earlier memd)."""
    _, at, owner = key.rpartition(OWNER)
    return OWNER[1:] + owner if at else None


def base_pool(pool_key: str) -> str:
    """A pool key's pool alone, without its configuration ("#...") or owner ("@uid:...")."""
    return pool_key.partition(OWNER)[0].partition("#")[0]


def _key(job: str, pool_key: str) -> str:
    return "%s|%s" % (job, pool_key)


def _split(key: str) -> Tuple[str, str]:
    """(job, pool key) of a stored key: split at its last "|", since a job name may hold one and
    the pool keys the daemon makes (planner.pool_key) do not."""
    job, _, pool = key.rpartition("|")
    return job, pool


def _memory(entry: dict) -> Memory:
    points = tuple(Observation(int(b), int(p)) for b, p in entry["points"])
    return Memory(points, entry.get("ceiling"), float(entry.get("updated", 0)), entry.get("clean", 0))


def _valid(key: object, entry: object) -> bool:
    """An entry as remember() writes it; anything else in the file (edited by hand, or by an older
    memd) is dropped at load. The bounds are remember()'s too, so one `curves` entry stays a
    few KiB (memd.curves)."""
    if not isinstance(key, str) or "|" not in key or len(key) > MAX_KEY_CHARS:
        return False
    if not isinstance(entry, dict) or not isinstance(entry.get("points"), list) or len(entry["points"]) > MAX_POINTS:
        return False
    ceiling, updated = entry.get("ceiling"), entry.get("updated", 0)
    if ceiling is not None and not _count(ceiling):
        return False
    if "clean" in entry and not (_count(entry["clean"]) and entry["clean"] < 1000):
        return False
    if not isinstance(updated, (int, float)) or isinstance(updated, bool) or not math.isfinite(updated):
        return False
    return all(isinstance(p, list) and len(p) == 2 and all(_count(v) for v in p) for p in entry["points"])


def _count(value: object) -> bool:
    return whole(value) and 0 < value <= MAX_INT
