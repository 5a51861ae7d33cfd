"""The daemon's lifecycle: two threads, signals, systemd notification, reload.

The sampler thread reads the machine every ``interval`` (and each job's process tree every
``job_interval``) and publishes the results on the Core; the main thread answers requests and
does the housekeeping: expiring sessions, persisting what was learned, and pinging systemd's
watchdog only while the sampler's heartbeat is fresh, so a hung driver call or a dead sampler
gets the service restarted.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Set

import structlog

from memd import config as config_module
from memd import metrics, ops, visibility, zap
from memd.client import curve
from memd.config import Config
from memd.core import VERSION, Core
from memd.logs import configure_logging
from memd.notify import Notifier
from memd.policy.pressure import host_signals, next_state
from memd.sampling import procs
from memd.sampling.sampler import Sampler
from memd.sampling.snapshot import JobMemory, Snapshot
from memd.server import Server
from memd.sessions import SessionRecord, Sessions
from memd.state import StateStore

log = structlog.get_logger("memd")

HOUSEKEEPING = 1.0  # seconds between session expiry passes
STATUS_EVERY = 0.5  # seconds between checks of the STATUS= line (sent to systemd only when it changed)


class Daemon:
    def __init__(self, cfg: Config, sampler: Optional[Sampler] = None, notifier: Optional[Notifier] = None,
                 reload: Optional[Callable[[], Config]] = None, clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.clock = clock
        self.reload_config = reload
        self.sampler = sampler or Sampler.default()
        self.notifier = notifier or Notifier()
        self.store = StateStore(cfg.resolved_state_dir())
        sessions = Sessions(cfg.max_sessions, cfg.session_ttl, clock, self._alive)
        self.core = Core(cfg, sessions, self.store, clock=clock, proc_root=self.sampler.proc_root)
        self.server = Server(cfg.resolved_endpoint(), self._dispatch(), self.core.observe_request,
                             curve_secret_key=_curve_key(cfg), client_keys=_client_keys(cfg),
                             max_connections=cfg.max_connections)
        self.metrics: Optional[metrics.MetricsServer] = None
        self._stop = threading.Event()
        self._reload = threading.Event()
        self._sampler_thread: Optional[threading.Thread] = None
        self._status = ""  # the STATUS= line systemd last got

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Bind, serve metrics, sample once, start the sampler; ConfigError if anything is taken.
        Bound first: a daemon that cannot bind says only why (it printed what NVML said first);
        requests wait in the socket until run(), and a scrape before the first sample shows the
        daemon's own metrics."""
        self.store.remove_stale_temps(before=time.time())
        self.store.load()
        self.server.bind()
        try:
            if self.cfg.metrics_address != "off":
                self.metrics = metrics.serve(self.core, self.cfg.metrics_address)
            snap = self._sample_once(jobs=False)
        except BaseException:
            self.server.close()
            if self.metrics is not None:
                self.metrics.shutdown()
            raise
        self._sampler_thread = threading.Thread(target=self._sample_loop, name="memd-sampler", daemon=True)
        self._sampler_thread.start()
        log.info("memd_ready", version=VERSION, endpoint=self.server.endpoint, metrics=self.cfg.metrics_address,
                 memory_model=snap.memory_model, gpus=len(snap.gpus), state_dir=self.store.directory,
                 remembered_jobs=len(self.store), curve_clients=_admitted(self.server))
        self._status = self.status_line()
        self.notifier.ready(self._status)

    def run(self) -> None:
        last_housekeeping = last_watchdog = last_flush = last_status = self.clock()
        while not self._stop.is_set():
            self.server.poll(min(self.cfg.interval, HOUSEKEEPING))
            now = self.clock()
            if self._reload.is_set():
                self._reload.clear()
                self.notifier.reloading()
                self._apply_reload()
                self._status = self.status_line()
                self.notifier.ready(self._status)  # reloaded or refused: serving either way
            if now - last_housekeeping >= HOUSEKEEPING:
                last_housekeeping = now
                self._expire()
            interval = self.notifier.watchdog_interval
            if interval is not None and now - last_watchdog >= interval and self.sampler_healthy(now):
                self.notifier.watchdog()
                last_watchdog = now
            if now - last_status >= STATUS_EVERY:
                last_status = now
                self._update_status()
            if now - last_flush >= self.cfg.flush_interval:
                last_flush = now
                self._remember_live()
                self.store.flush_soon()

    def shutdown(self) -> None:
        self.notifier.stopping()
        self._stop.set()
        if self._sampler_thread is not None:
            self._sampler_thread.join(timeout=2.0)
        for session in self.core.sessions:
            ops.remember(self.core, session)
        self.store.close()
        self.store.flush()
        self.server.close()
        if self.metrics is not None:
            self.metrics.shutdown()
        self.notifier.close()
        self.sampler.close()
        log.info("memd_stopped", sessions=len(self.core.sessions))

    def stop(self, *_args) -> None:
        self._stop.set()

    def request_reload(self, *_args) -> None:
        self._reload.set()

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
        signal.signal(signal.SIGHUP, self.request_reload)

    def status_line(self) -> str:
        """What `systemctl status memd` shows under the unit's name: the sessions and the pressure."""
        n = len(self.core.sessions)
        line = "%d training session%s, memory pressure %s" % (n, "" if n == 1 else "s", self.core.pressure.level)
        if self.core.ooms_reported:
            line += ", %d out-of-memory reports" % self.core.ooms_reported
        return line

    def _update_status(self) -> None:
        line = self.status_line()
        if line != self._status:  # a datagram only when something changed
            self._status = line
            self.notifier.status(line)

    def sampler_healthy(self, now: float) -> bool:
        stale_after = max(5 * self.cfg.interval, 2.0)
        alive = self._sampler_thread is not None and self._sampler_thread.is_alive()
        return alive and now - self.core.sampler_heartbeat <= stale_after

    # -- sampler thread ---------------------------------------------------------------------

    def _sample_loop(self) -> None:
        next_jobs = 0.0
        while not self._stop.is_set():
            started = self.clock()
            try:
                self._sample_once(jobs=started >= next_jobs)
                if started >= next_jobs:
                    next_jobs = started + self.cfg.job_interval
            except Exception:
                self.core.sample_errors["sampler"] += 1
                log.exception("sampling_failed", kept="the previous snapshot")
            self._stop.wait(max(0.0, self.cfg.interval - (self.clock() - started)))

    def _sample_once(self, jobs: bool) -> Snapshot:
        snap = self.sampler.sample()
        core = self.core
        core.pressure = next_state(core.pressure, host_signals(snap), snap.monotonic, self.cfg.policy)
        core.snapshot = snap
        for source, _message in snap.errors:
            core.sample_errors[source] += 1
        pids = {s.pid for s in core.sessions if s.local}
        if jobs:
            core.jobs = {pid: self._read_job(pid, snap) for pid in pids}
        else:
            # A new session: its cgroup and tree bound its next plan. Every other job without
            # workers: its pool and trainer read again (Sampler.paired), so a neighbour's growth
            # shows within a sample. A job with workers keeps its tree's read: its room is its
            # workers' too, and they are read with the tree.
            fresh = {pid: self._read_job(pid, snap) for pid in pids - core.jobs.keys()}
            core.jobs = {**{pid: job for pid, job in core.jobs.items() if pid in pids}, **fresh}
        core.jobs = {**core.jobs, **self._paired_by_pool(core.jobs, set(core.jobs) if jobs else set(fresh))}
        core.sampler_heartbeat = self.clock()
        return snap

    def _paired_by_pool(self, jobs: Dict[int, JobMemory], just_read: Set[int]) -> Dict[int, JobMemory]:
        """The jobs without workers read again, those of one pool together (Sampler.paired_pool):
        what one job's steps hold is then never counted as the others' neighbour, read at
        another instant. A job alone in its pool and ``just_read`` keeps its read's own pairing."""
        pools: Dict[object, List[JobMemory]] = {}
        for job in jobs.values():
            if job.alive and len(job.processes) == 1:  # one group's jobs together; a job whose group is unknown alone
                pools.setdefault(job.cgroup.path if job.cgroup is not None else job.pid, []).append(job)
        return {job.pid: job for group in pools.values() if len(group) > 1 or group[0].pid not in just_read
                for job in self.sampler.paired_pool(group)}

    def _read_job(self, pid: int, snap):
        """A job's tree and cgroup. A cgroup, or a live process, that could not be read this time
        keeps its last reading (counted as a sampling error): unknown is not unlimited, and a job
        bounded by a 1 GiB group must never be budgeted from the machine's RAM because one read
        failed."""
        job = self.sampler.job(pid, snap.gpus)
        last = self.core.jobs.get(pid)
        if not job.alive and last is not None and last.alive and procs.process_start_time(pid, self.core.proc_root):
            self.core.sample_errors["procs"] += 1
            return last  # the process is there but could not be read this time: its last reading stands
        failed = [m for source, m in job.errors if source == "cgroup"]
        if failed:
            self.core.sample_errors["cgroup"] += len(failed)
            if job.cgroup is None and last is not None and last.cgroup is not None and job.alive:
                job = dataclasses.replace(job, cgroup=last.cgroup)
        return job

    # -- main thread ------------------------------------------------------------------------

    def _dispatch(self):
        handlers = {name: (lambda req, handler=handler: handler(self.core, req))
                    for name, handler in ops.HANDLERS.items()}
        # Who asks, as the kernel says (ipc, loopback tcp) and as the CURVE allow-list admitted it
        handlers["hello"] = lambda req: ops.hello(self.core, req, self.server.peer, self.server.key)
        # Each peer sees (and forgets) what it may: memd.visibility
        handlers["status"] = lambda req: ops.status(self.core, req, self._viewer())
        handlers["curves"] = lambda req: ops.curves(self.core, req, self._viewer())
        handlers["forget"] = lambda req: ops.forget(self.core, req, self._viewer())
        return handlers

    def _viewer(self) -> visibility.Viewer:
        return visibility.viewer(self.server.sender(pid=False), self.server.key, os.geteuid())

    def _alive(self, session: SessionRecord) -> bool:
        if not session.local:
            return True  # only silence (ttl) ends a session whose process memd cannot see
        return procs.process_start_time(session.pid, self.core.proc_root) == session.start_time

    def _remember_live(self) -> None:
        """Keep what live sessions learned so far, so that a daemon killed outright (SIGKILL, a
        power cut) loses at most ``flush_interval`` of it; unchanged sessions write nothing."""
        for session in self.core.sessions:
            mark = (session.reports, session.ooms)
            if session.remembered_mark != mark:
                ops.remember(self.core, session)
                session.remembered_mark = mark

    def _expire(self) -> None:
        ops.expire(self.core)

    def _apply_reload(self) -> None:
        if self.reload_config is None:
            return
        try:
            new = self.reload_config()
        except config_module.ConfigError as exc:
            log.error("reload_refused", error=str(exc), kept="the running configuration")
            return
        kept = [name for name in ("endpoint", "metrics_address", "state_dir", "curve_secret_key_file")
                if getattr(new, name) != getattr(self.cfg, name)]
        if kept:
            log.warning("reload_needs_restart", keys=kept, detail="these keep their values until memd restarts")
        if "curve_secret_key_file" in kept:  # CURVE and its allow-list come and go together
            kept.append("curve_client_keys_dir")
        new = dataclasses.replace(new, **{name: getattr(self.cfg, name) for name in kept})
        try:
            allowed = _client_keys(new)  # re-read: adding or removing a client's key file needs no restart
        except config_module.ConfigError as exc:
            log.error("reload_refused", error=str(exc), kept="the running configuration")
            return
        self.cfg = new
        self.core.config = new
        self.core.sessions.max_sessions = new.max_sessions
        self.core.sessions.ttl = new.session_ttl
        self.server.max_connections = new.max_connections
        if self.server.guard is not None:
            self.server.guard.max_connections = new.max_connections  # new connections; those beyond stay
        configure_logging(new)
        if allowed is not None and self.server.zap is not None:
            self.server.zap.admit(allowed)  # new handshakes only: connections admitted before stay
        log.info("config_reloaded", curve_clients=_admitted(self.server))


def serve(cfg: Config, reload: Optional[Callable[[], Config]] = None) -> int:
    """Run in the foreground until SIGTERM/SIGINT. Returns the process exit code."""
    configure_logging(cfg)
    try:
        daemon = Daemon(cfg, reload=reload)
        daemon.install_signal_handlers()
        daemon.start()
    except config_module.ConfigError as exc:
        print("memd: %s" % exc, file=sys.stderr)
        return 2
    try:
        daemon.run()
    finally:
        daemon.shutdown()
    return 0


def _curve_key(cfg: Config) -> Optional[bytes]:
    """The daemon's CURVE secret key (Z85) from its .key_secret file (or a bare 40-character key)."""
    if not cfg.curve_secret_key_file:
        return None
    try:
        return curve.read_keypair(cfg.curve_secret_key_file, "curve_secret_key_file")[1]
    except ValueError as exc:
        raise config_module.ConfigError(str(exc)) from None


def _client_keys(cfg: Config):
    """The allow-list of client keys, read now (at start, and again at each reload)."""
    if not cfg.curve_client_keys_dir:
        return None
    allowed = zap.load_allow_list(cfg.curve_client_keys_dir)
    if not allowed:
        log.warning("curve_no_client_keys", dir=cfg.curve_client_keys_dir,
                    detail="curve_client_keys_dir holds no *.key file: no client is admitted")
    return allowed


def _admitted(server: Server) -> Optional[int]:
    return None if server.zap is None else len(server.zap.allowed)
