"""What memd learned, kept across restarts: each job's memory curve per kind of pool.

One JSON file under the state directory, replaced atomically (write, fsync, rename), so a
crash or power loss leaves either the old file or the new one. A corrupt file is moved aside
and memd starts empty rather than not at all. Bounded: the least recently used jobs go first.
Curves owned by a CURVE key (remote clients, "@key:...") are bounded apart from the others, and
per key: a key's flood of job names evicts its own curves, never a local job's (docs/security.md).
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
from typing import Any, Callable, Dict, List, Optional, Tuple

import structlog

from memd.client.counts import whole
from memd.policy.fit import Observation
from memd.sessions import KEY_OWNER, OWNER

FILE = "curves.json"
VERSION = 1
MAX_JOBS = 512  # curves of local jobs (and, apart, of CURVE keys: each its own class, so neither evicts the other)
MAX_JOBS_PER_KEY = 32  # curves one CURVE key keeps: beyond, its own least recently used go
MAX_POINTS = 32
CAUSES = ("oom", "kill")  # why a ceiling is there: a caught out-of-memory error, or the OOM killer
MAX_KEY_CHARS = 512  # "job|pool": a job name (128) and a pool key the daemon made; bounds a `curves` entry
MAX_INT = 2 ** 63 - 1  # what msgpack carries: a hand-edited file's 10**30 would fail every reply that shows it
TEMP_PREFIX = ".curves."
_TEMP = re.compile(r"\.curves\.[a-z0-9_]{8}\Z")  # what tempfile.mkstemp(prefix=TEMP_PREFIX) names
_Z85_KEY = re.compile(r"[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}\Z")  # a CURVE public key as ZAP's User-Id gives it

log = structlog.get_logger("memd.state")


@dataclass(frozen=True)
class Memory:
    observations: Tuple[Observation, ...]
    ceiling: Optional[int]
    updated: float
    clean_runs: int = 0  # runs since the ceiling that went clean at it (sessions.SessionRecord.learned)
    # Why there is a ceiling: "oom" (a step's out-of-memory error, reported) or "kill" (the kernel's
    # OOM killer ended the job: memd.ops.lifecycle.learn_kill)
    cause: Optional[str] = None


class StateStore:
    def __init__(self, directory: str, max_jobs: int = MAX_JOBS, max_per_key: int = MAX_JOBS_PER_KEY):
        self.directory = directory
        self.max_jobs = max_jobs
        self.max_per_key = max_per_key
        self.path = os.path.join(directory, FILE)
        self._jobs: Dict[str, dict] = {}
        self._owners: collections.Counter = collections.Counter()  # owner_of(key) -> curves kept, of _jobs
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
        self._owners = collections.Counter(owner_of(key) for key in self._jobs)

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

    def forget(self, job: str, pool_key: Optional[str] = None,
               mine: Optional[Callable[[Optional[str]], bool]] = None) -> List[str]:
        """Drop what was learned for ``job``, in every pool or only ``pool_key`` (a pool key
        without its configuration and owner, planner.identify's "#..." and "@uid:...", names every
        configuration and owner in that pool), of every owner or only those whose owner
        (owner_of: "uid:N", "key:..." or None) ``mine`` accepts (memd.visibility); returns the
        pool keys dropped, sorted. The store is dirty (flush writes it) only if one was."""
        dropped = []
        for key in list(self._jobs):
            name, pool = _split(key)
            if name == job and pool_key in (None, pool, base_pool(pool)) and (mine is None or mine(owner_of(pool))):
                self._drop(key)
                dropped.append(pool)
        if dropped:
            self.dirty = True
        return sorted(dropped)

    def remember(self, job: str, pool_key: str, observations: List[Observation], ceiling: Optional[int],
                 clean_runs: int = 0, cause: Optional[str] = None) -> None:
        points = [[o.batch, o.peak_bytes] for o in observations if o.peak_bytes > 0]
        if len(points) > MAX_POINTS:  # the oldest of the most repeated batch size goes (SessionRecord.observe)
            points = trimmed(points, MAX_POINTS)
        key = _key(job, pool_key)
        if not points and ceiling is None:  # nothing left to keep (a lifted ceiling was all there was)
            if key in self._jobs:
                self._drop(key)
                self.dirty = True
            return
        if len(key) > MAX_KEY_CHARS:  # cannot happen (a job is 128 characters, NVML's names 96): the bound holds
            log.warning("state_key_too_long", job=job[:128], pool=pool_key[:128])
            return
        entry: Dict[str, Any] = {"points": points, "ceiling": ceiling, "updated": time.time()}
        if ceiling is not None and clean_runs:
            entry["clean"] = clean_runs
        if ceiling is not None and cause in CAUSES:
            entry["cause"] = cause
        self._drop(key)  # re-insert: dict order is the LRU order
        self._jobs[key] = entry
        owner = owner_of(key)
        self._owners[owner] += 1
        keyed = is_key(owner)
        if keyed and self._owners[owner] > self.max_per_key:  # a key's flood of names: its own go
            self._drop(next(k for k in self._jobs if owner_of(k) == owner))
        while sum(n for o, n in self._owners.items() if is_key(o) == keyed) > self.max_jobs:
            self._drop(self._evictable(keyed))
        self.dirty = True

    def _drop(self, key: str) -> None:
        if self._jobs.pop(key, None) is not None:
            owner = owner_of(key)
            self._owners[owner] -= 1
            if not self._owners[owner]:
                del self._owners[owner]

    def _evictable(self, keyed: bool) -> str:
        """The least recently used key of the owner with the most, among the CURVE keys' curves
        (``keyed``) or the others': a user who fills the store (512 junk job names once evicted
        every curve) evicts their own first, and a remote key never a local job's."""
        most = max(n for o, n in self._owners.items() if is_key(o) == keyed)
        return next(k for k in self._jobs if is_key(owner_of(k)) == keyed and self._owners[owner_of(k)] == most)

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


def split_owner(key: str) -> Tuple[str, Optional[str]]:
    """A stored key or pool key as (what comes before its owner, the owner: "uid:1000", or
    "key:" and a client's CURVE public key), the owner None for a key without one (kept by an
    earlier memd). A Z85 key may hold "@", "#" and ":", so a key owner is found by its fixed
    length at the end, before anything is split at those."""
    tail = key[-len(KEY_OWNER) - 40:]
    if tail.startswith(KEY_OWNER) and _Z85_KEY.match(tail[len(KEY_OWNER):]):
        return key[:-len(tail)], tail[1:]
    before, at, uid = key.rpartition(OWNER)
    return (before, OWNER[1:] + uid) if at else (key, None)


def owner_of(key: str) -> Optional[str]:
    """The owner part of a stored key or pool key (split_owner)."""
    return split_owner(key)[1]


def is_key(owner: Optional[str]) -> bool:
    """Whether an owner (owner_of) is a CURVE key, not a uid."""
    return owner is not None and owner.startswith(KEY_OWNER[1:])


def base_pool(pool_key: str) -> str:
    """A pool key's pool alone, without its configuration ("#...") or owner ("@uid:...", "@key:...")."""
    return split_owner(pool_key)[0].partition("#")[0]


def _key(job: str, pool_key: str) -> str:
    return "%s|%s" % (job, pool_key)


def _split(key: str) -> Tuple[str, str]:
    """(job, pool key) of a stored key: split at its last "|", since a job name may hold one and
    the pool keys the daemon makes (planner.pool_key) do not."""
    job, _, pool = key.rpartition("|")
    return job, pool


def trimmed(points: List[List[int]], keep: int) -> List[List[int]]:
    """``points`` ([batch, peak], oldest first) less, ``len(points) - keep`` times, the oldest of a
    batch size with the most (ties: the batch size whose oldest is the oldest), worked out at
    once: each batch size keeps its newest, and the counts fall from the top as water does.
    Point by point, every session's 64 reports were counted again for each of the 32 dropped,
    at every flush (2 s)."""
    at: Dict[int, List[int]] = {}  # each batch size's points' indices, oldest first
    for i, (batch, _) in enumerate(points):
        at.setdefault(batch, []).append(i)
    drop = len(points) - keep
    if drop <= 0:
        return points
    # The level the counts come down to: every batch size above it is cut to it (``cut`` drops),
    # then ``extra`` of those at it, the one holding the oldest point first, to one below.
    sizes = sorted((len(v) for v in at.values()), reverse=True)
    level, cut = sizes[0], 0
    while True:
        at_level = sum(1 for n in sizes if n >= level)  # batch sizes that hold ``level`` once cut to it
        if cut + at_level >= drop:
            break
        cut += at_level
        level -= 1
    extra = drop - cut  # 1..at_level
    oldest = sorted((v[len(v) - level], b) for b, v in at.items() if len(v) >= level)
    keeps = {b: min(len(v), level) for b, v in at.items()}
    for _, batch in oldest[:extra]:
        keeps[batch] = level - 1
    kept = sorted(i for b, v in at.items() for i in v[len(v) - keeps[b]:])
    return [points[i] for i in kept]


def _memory(entry: dict) -> Memory:
    points = tuple(Observation(int(b), int(p)) for b, p in entry["points"])
    return Memory(points, entry.get("ceiling"), float(entry.get("updated", 0)), entry.get("clean", 0),
                  entry.get("cause"))


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
    if "cause" in entry and entry["cause"] not in CAUSES:
        return False
    if not isinstance(updated, (int, float)) or isinstance(updated, bool) or not math.isfinite(updated):
        return False
    return all(isinstance(p, list) and len(p) == 2 and all(_count(v) for v in p) for p in entry["points"])


def _count(value: object) -> bool:
    return whole(value) and 0 < value <= MAX_INT
