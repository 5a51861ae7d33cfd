"""Registered training jobs: who they are, what they reported, and when they go away.

A session is identified by an unguessable token that only its holder knows; it ends with
``bye``, when its process is gone, or after ``ttl`` seconds of silence. The registry is bounded
(``max_sessions``) and each session keeps a bounded history, so the daemon stays small however
long it runs. A client's ``nonce`` (a secret of its own, sent with every hello of one client
Session) finds the session an earlier hello opened, so a hello retried after its reply was lost
does not open a second one. The registry only holds sessions: what ending one means (remember
its curve, count it) is ops.end's, for bye, expiry and eviction alike. Owned by the server
thread: no locking here.
"""
from __future__ import annotations

import collections
import secrets
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Counter, Deque, Dict, Iterable, Iterator, List, NamedTuple, Optional, Tuple

from memd.client.plan import Plan
from memd.planner_memo import PlannerMemo
from memd.policy.controller import ControlState, Decision, Limits, WorkerFacts
from memd.policy.fit import Observation, Prior
from memd.sampling.snapshot import Cgroup

HISTORY = 64  # reports kept per session: enough for a robust fit, small enough to bound memory
OWNER = "@uid:"  # a curve's key ends with its owner's uid (planner.ownership, state.owner_of)
KEY_OWNER = "@key:"  # or with the CURVE public key (40 Z85 characters) of the client that said hello


class Peer(NamedTuple):
    """Who sent a message, in the kernel's word (SO_PEERCRED on the ipc socket), not the client's."""
    uid: int
    pid: Optional[int]  # None where the platform gives no pid (LOCAL_PEERCRED)


UNWATCHED_SHARE = 0.25  # of max_sessions, at most, for sessions whose process memd cannot watch
# Runs that must go clean at a remembered OOM ceiling before it is lifted (SessionRecord.learned).
CLEAN_RUNS = 3


def _newest_of_busiest(sessions: Iterable[SessionRecord]) -> Optional[SessionRecord]:
    """The newest session of the process that holds the most of ``sessions``."""
    listed = list(sessions)
    if not listed:
        return None
    busiest = collections.Counter(s.peer_pid for s in listed).most_common(1)[0][0]
    return max((s for s in listed if s.peer_pid == busiest), key=lambda s: s.sid)


def _first_of_most(batches: List[int], counts: Dict[int, int]) -> int:
    """The index in ``batches`` of the first report of a batch size with the most (``counts``:
    reports per batch size): the one a full history drops. list.index scans in C: a generator
    over the 64 records was a tenth of a report's time, reading their batches off them 15 us
    in the daemon under load."""
    most = max(counts.values())
    tied = [b for b, n in counts.items() if n == most]
    return batches.index(tied[0]) if len(tied) == 1 else min(map(batches.index, tied))


def _unwatched_slots(max_sessions: int) -> int:
    """The slots sessions whose process the daemon cannot watch may hold together."""
    return max(1, int(max_sessions * UNWATCHED_SHARE))


def _user(key: Optional[str], uid: Optional[int]) -> object:
    """Who a session or a hello is, in the sharing of slots: its CURVE key where it came with
    one, else its uid (the ipc socket's, or a loopback TCP connection's owner: memd.loopback;
    None where the kernel did not tell, and every such peer is the same one)."""
    return ("key", key) if key is not None else uid


class UnknownSession(KeyError):
    pass


class TooManySessions(RuntimeError):
    pass


@dataclass
class SessionRecord:
    """The daemon's record of one registered job (a client's ``memd.client.Session`` on the other end)."""

    token: str
    sid: int  # a small number naming the session in metrics and logs (the token is a secret)
    job: str
    pid: int
    host: str
    local: bool  # the pid is a process on this host that the daemon can watch
    start_time: Optional[int]  # the pid's start time, so a reused pid is not mistaken for it
    limits: Limits
    created: float
    last_seen: float
    rank: Optional[int] = None
    world_size: Optional[int] = None
    device: Optional[str] = None
    device_uuid: Optional[str] = None
    visible_devices: Optional[str] = None
    hints: Dict[str, object] = field(default_factory=dict)
    prior: Optional[Prior] = None
    remembered: List[Observation] = field(default_factory=list)  # from an earlier run of this job
    observations: List[Observation] = field(default_factory=list)  # in order; see observe()
    batch_counts: Counter[int] = field(default_factory=collections.Counter)  # observe()'s, of the above
    observed_batches: List[int] = field(default_factory=list)  # observe()'s: each one's batch, in order
    state: ControlState = field(default_factory=ControlState)
    plan: Optional[Plan] = None
    pool: Optional[str] = None  # the pool of the last decision ("host" or a GPU uuid)
    budget_bytes: Optional[int] = None
    pool_budget_bytes: Optional[int] = None  # the budget_bytes and its workers' share (Decision)
    predicted_peak_bytes: Optional[float] = None
    workers: Optional[WorkerFacts] = None  # its dataloader workers as the last decision saw them
    wanted_peak_bytes: Optional[int] = None  # the peak it would plan for with its pool to itself
    latest_peak: Optional[int] = None
    # (when, the largest peak reported since the last OOM, as of then): what the job's allocator holds
    held: Deque[Tuple[float, Optional[int]]] = field(default_factory=lambda: collections.deque(maxlen=32))
    latest_batch: Optional[int] = None
    cpus: Optional[float] = None  # what the client said it may use (its affinity), before a job read
    local_world_size: Optional[int] = None  # ranks of the job on this node
    nonce: Optional[str] = None  # the client Session's own secret: a retried hello finds this session
    cgroup: Optional[Cgroup] = None  # the job's memory cgroup as read at hello (None: not local, unreadable)
    owner: Optional[int] = None  # the uid its watched process runs as: its curves are its owner's
    rejoined: bool = False  # said hello running a batch already (the daemon restarted under it)
    unwatched: Optional[str] = None  # why a job on this host is not local (its pid here is another process)
    peer_uid: Optional[int] = None  # the user whose process said hello (the kernel's word, ipc or loopback tcp)
    peer_pid: Optional[int] = None  # and that process, as this daemon's pid namespace names it
    # The CURVE public key (Z85) the hello came with, authenticated by the allow-list (memd.zap):
    # its curves are that key's, and it is that key's slot in the sharing between users (crowding)
    key: Optional[str] = None
    # The Kubernetes pod (UID) and Slurm job it runs in, and how that is known (memd.attribution)
    pod_uid: Optional[str] = None
    slurm_job_id: Optional[str] = None
    attributed_by: Optional[str] = None
    pool_key: Optional[str] = None  # what its curves are looked up and saved under (planner.identify)
    batch_bytes: Optional[int] = None  # one batch's tensors, as the client's loader reported them
    # Its loader follows the plan's workers (a report said which it ran, as MemdLoader's do): the
    # batch goes beside the workers the plan keeps, not beside old ones about to be shut down.
    follows_workers: bool = False
    # The planner's own scratch between decisions (its workers' course, the pool's last reads):
    # not the session's state, and nothing but memd.planner reads it
    planner: PlannerMemo = field(default_factory=PlannerMemo)
    reports: int = 0
    ooms: int = 0
    # OOMs since its last completed step: 0 again once it steps on the plan memd gave after them
    # (the OOM alert's "handled"; docs/deploy.md#memdtrainingoom)
    ooms_unrecovered: int = 0
    decided: Optional[Tuple[tuple, Decision]] = None  # (inputs, Decision) memo of memd.ops.memo.decide
    remembered_mark: Optional[Tuple[int, int]] = None  # (reports, ooms) when last written to the state
    observed: int = 0  # observations ever added (observe), however many the history still holds
    observed_at: List[int] = field(default_factory=list)  # each kept observation's number (observe)
    forgotten: Optional[Tuple[int, int]] = None  # (observed, ooms) when its job was last forgotten
    # An OOM ceiling from earlier runs of its job (at hello), and how many runs since went clean at it
    inherited_ceiling: Optional[int] = None
    clean_runs: int = 0
    ceiling_cause: Optional[str] = None  # why its ceiling is there: "oom" (reported) or "kill" (state.CAUSES)
    # Its latest report said its peak (else the daemon measured it): on the host its peaks are then
    # taken to count its resident set, file pages included (budget.host_pool's ``resident``)
    reports_peaks: bool = False
    held_before_steps: Optional[int] = None  # what its trainer held as it said hello (watch.held_now)
    # The OOM killer's counts as of its latest decision: (its group's path, cgroup version, the
    # group's kills, the host's), to tell a process that vanished from one that was killed
    kill_marks: Optional[Tuple[Optional[str], int, Optional[int], Optional[int]]] = None
    at_ceiling: bool = False  # its latest plan was held down by its ceiling
    ceiling_steps: int = 0  # reports while at_ceiling
    reported_at: Deque[float] = field(default_factory=lambda: collections.deque(maxlen=6))  # its latest reports' times

    @property
    def step_seconds(self) -> Optional[float]:
        """How long one of its steps takes, as its latest reports came (the median gap): a new plan
        takes effect at its next step. None before two reports."""
        times = self.reported_at
        if len(times) < 2:
            return None
        return statistics.median(b - a for a, b in zip(times, list(times)[1:]))

    def forget_learned(self) -> None:
        """`memd forget` of this job: what it learned until now is never remembered (else the
        next flush or its bye would write the forgotten curve back). Its own plan keeps using
        it: a running job is not sent back to its default mid-run."""
        self.forgotten = (self.observed, self.ooms)

    def learned(self, stable_steps: int) -> Tuple[List[Observation], Optional[int], int]:
        """What may be kept for the job's next run: the points its earlier runs left (while this
        run's reports agree with them: planner.check_remembered), its observations past the
        warm-up, its OOM ceiling, and how many runs in a row went clean at that ceiling; all only
        from after the last forget of its job (a ceiling it started with, or reached before, was
        forgotten with the curve).

        A ceiling is one failed step's word, and that step may have failed for a reason that is
        gone (another job's memory on the GPU, a fragmented cache, one long batch). A run that
        was held at the ceiling for ``stable_steps`` steps and never ran out of memory counts as
        clean; after CLEAN_RUNS of them the ceiling is lifted and the next run may try above it.
        Where the ceiling was right, that costs one caught out-of-memory step (and a new
        ceiling) every CLEAN_RUNS + 1 runs; a ceiling never re-tried cost every later run of a
        job name the batches above it, for good."""
        history = list(self.observations)
        if self.forgotten is None:  # what its earlier runs left, unless this run's reports disagreed
            kept = list(self.remembered) + [o for o in history if not o.warmup]
            oomed, inherited = self.ooms > 0, self.inherited_ceiling
        else:
            observed, ooms = self.forgotten
            since = [o for o, n in zip(history, self.observed_at) if n >= observed]
            kept, oomed, inherited = [o for o in since if not o.warmup], self.ooms > ooms, None
        if oomed:
            return kept, self.state.ceiling, 0
        if inherited is None:
            return kept, None, 0
        if self.ceiling_cause == "kill":  # a kill is not retried: another try is another dead job
            return kept, inherited, 0
        clean = self.clean_runs + (1 if self.ceiling_steps >= stable_steps else 0)
        return (kept, None, 0) if clean >= CLEAN_RUNS else (kept, inherited, clean)

    def observe(self, observation: Observation) -> None:
        """Keep a report, at most HISTORY of them. When full, the oldest report of the batch size
        with the most goes: a curve needs batch sizes more than repeats of one. Dropping the oldest
        of all, a loader that ran 250 steps at batch 1 forgot its steps at 32, and the one batch
        size left bounded a sample at the whole process (0.69 GiB): it stayed at 1 for good."""
        counts = self.batch_counts  # of the observations kept, per batch size (kept here, not counted each time)
        batches = self.observed_batches  # each kept observation's batch: scanned as ints, not read off 64 records
        if len(self.observations) >= HISTORY:
            victim = _first_of_most(batches, counts)
            gone = batches[victim]
            counts[gone] -= 1
            if not counts[gone]:
                del counts[gone]
            del self.observations[victim], self.observed_at[victim], batches[victim]
        counts[observation.batch] += 1
        self.observations.append(observation)
        self.observed_at.append(self.observed)
        batches.append(observation.batch)
        self.observed += 1

    def note_peak(self, when: float, peak: int) -> None:
        previous = self.held[-1][1] if self.held else 0
        self.held.append((when, max(peak, previous or 0)))

    def note_oom(self, when: float) -> None:
        # What the job holds after an out-of-memory error is unknown: PyTorch releases its unused
        # cached blocks, the failed step's go back to its cache, the loop may empty it. Unknown
        # until the next report (None).
        self.held.append((when, None))

    def peak_held_at(self, when: float) -> int:
        """What the job held at ``when``, in its reported units: the largest peak reported since
        its last OOM, because caching allocators keep what they once reserved (0 when nothing
        was reported by then, or since its last OOM). A snapshot's free memory is paired with the
        job's holding *when the snapshot was taken*: a newer report would count the job's growth
        twice."""
        for noted_at, value in reversed(self.held):  # from the newest: at most a few steps back
            if noted_at <= when:
                return value or 0
        return 0

    def holding_unknown(self) -> bool:
        """An out-of-memory error since the job's last report (note_oom)."""
        return bool(self.held) and self.held[-1][1] is None


class Sessions:
    def __init__(self, max_sessions: int, ttl: float, clock: Callable[[], float],
                 alive: Callable[[SessionRecord], bool]):
        self.max_sessions = max_sessions
        self.ttl = ttl
        self.clock = clock
        self.alive = alive  # False once a local session's process is gone
        self._by_token: Dict[str, SessionRecord] = {}
        self._by_nonce: Dict[Tuple[str, int, str], SessionRecord] = {}
        self._next_sid = 0
        self.version = 0  # changes as sessions open and end: the planner's claims are gathered again
        self.claims: Dict[Optional[str], Any] = {}  # the planner's, per pool (planner.neighbours)

    def full(self) -> bool:
        return len(self._by_token) >= self.max_sessions

    def open(self, **fields) -> SessionRecord:
        """A new session; TooManySessions when full (the caller expires the dead ones first, and
        ends them: see ops.end), or when a quarter of the slots (UNWATCHED_SHARE) hold sessions
        whose process the daemon cannot watch and this would be one more: those end only after
        ``ttl`` of silence, and 256 of them from one peer held every slot long after it left."""
        if self.full():
            raise TooManySessions("%d sessions are open (max_sessions)" % self.max_sessions)
        unwatched = sum(1 for s in self._by_token.values() if not s.local)
        if not fields.get("local", True) and unwatched >= _unwatched_slots(self.max_sessions):
            raise TooManySessions("%d sessions of processes the daemon cannot watch are open (a quarter of "
                                  "max_sessions)" % unwatched)
        now = self.clock()
        self._next_sid += 1
        session = SessionRecord(token=secrets.token_urlsafe(18), sid=self._next_sid, created=now, last_seen=now,
                                **fields)
        self._by_token[session.token] = session
        self.version += 1
        if session.nonce is not None:
            self._by_nonce[(session.host, session.pid, session.nonce)] = session
        return session

    def crowding(self, peer: Optional[Peer], key: Optional[str] = None, local: bool = True) -> Optional[SessionRecord]:
        """When the slots a hello needs are taken, the session it may end to get one. Slots are
        shared max-min, between users and then between one user's processes: the newest session
        of the process holding the most, in the user holding the most, gives way when that user
        holds at least two more than the one asking (or, within one user, that process two more
        than the one asking). A user is the CURVE key the client was admitted with (``key``), else
        the uid the kernel names (ipc, loopback TCP); peers it does not name are one user. One user, or one
        process, alone may fill every slot, but a flood of hellos cannot keep another user's or
        another process's job out (256 sessions from one process once held every slot). A hello
        whose process the daemon cannot watch (``local`` false) shares only the unwatched
        sessions' quarter: a remote session never ends a local one. None when there is room."""
        everyone = list(self._by_token.values())
        if not local:
            everyone = [s for s in everyone if not s.local]
            if not self.full() and len(everyone) < _unwatched_slots(self.max_sessions):
                return None
        elif not self.full():
            return None
        uid, pid = (None, None) if peer is None else peer
        asking = _user(key, uid)
        users = collections.Counter(_user(s.key, s.peer_uid) for s in everyone)
        user, count = users.most_common(1)[0] if users else (None, 0)
        if user != asking and users[asking] + 1 < count:
            return _newest_of_busiest(s for s in everyone if _user(s.key, s.peer_uid) == user)
        mine = [s for s in everyone if _user(s.key, s.peer_uid) == asking]
        processes = collections.Counter(s.peer_pid for s in mine)
        process, count = processes.most_common(1)[0] if processes else (None, 0)
        if pid is not None and process != pid and processes[pid] + 1 < count:
            return _newest_of_busiest(s for s in mine if s.peer_pid == process)
        return None

    def find(self, host: str, pid: int, nonce: str) -> Optional[SessionRecord]:
        """The open session an earlier hello with this nonce opened for this process, if any."""
        session = self._by_nonce.get((host, pid, nonce))
        if session is not None:
            session.last_seen = self.clock()
        return session

    def get(self, token: object) -> SessionRecord:
        session = self._by_token.get(token) if isinstance(token, str) else None
        if session is None:
            raise UnknownSession("no session holds this token (expired, closed, or the daemon restarted)")
        session.last_seen = self.clock()
        return session

    def close(self, token: str) -> Optional[SessionRecord]:
        session = self._by_token.pop(token, None)
        if session is not None:
            self.version += 1
        if session is not None and session.nonce is not None:
            self._by_nonce.pop((session.host, session.pid, session.nonce), None)
        return session

    def expire(self) -> List[SessionRecord]:
        """Drop sessions whose process is gone or that were silent longer than ``ttl``."""
        now = self.clock()
        gone = [s for s in self._by_token.values() if now - s.last_seen > self.ttl or not self.alive(s)]
        for session in gone:
            self.close(session.token)
        return gone

    def __iter__(self) -> Iterator[SessionRecord]:
        return iter(list(self._by_token.values()))

    def __len__(self) -> int:
        return len(self._by_token)
