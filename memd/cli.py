"""memd's command line: serve | status | curves | forget | sample | estimate | doctor | top | keygen.

Every command that talks to a daemon takes --endpoint (default: as the client picks it),
--timeout, and for a CURVE daemon --server-key and --client-key (cli_call.py).
Errors end with one line on stderr and a non-zero exit code, never a traceback: 1 when no
daemon answers, 2 for bad input or configuration.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

from memd import cli_call, cli_curves, cli_estimate
from memd.client import DaemonUnavailable
from memd.config import ConfigError
from memd.core import VERSION
from memd.top import SORT_KEYS
from memd.units import GiB, MiB


def main(argv: Optional[List[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    if args.command != "serve":
        _quiet_logging()  # one-shot commands: stdout is for their output, warnings go to stderr
    try:
        return args.run(args)
    except ConfigError as exc:
        print("memd: %s" % exc, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


def _quiet_logging() -> None:
    from memd.config import Config
    from memd.logs import configure_logging

    configure_logging(Config(log_level="warning", log_format="console"), stream=sys.stderr)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memd", description="Memory daemon for machines that train neural networks.")
    parser.add_argument("--version", action="version", version="memd " + VERSION)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the daemon in the foreground")
    serve.add_argument("--config", metavar="FILE", help="TOML configuration file (optional; defaults are embedded)")
    serve.add_argument("--endpoint", metavar="E", help="control endpoint, ipc://PATH or tcp://127.0.0.1:PORT")
    serve.add_argument("--metrics-address", metavar="A",
                       help="HOST:PORT for /metrics, or 'off' (default 127.0.0.1:9463)")
    serve.add_argument("--interval", metavar="S", type=str, help="seconds between samples (default 0.2)")
    serve.add_argument("--state-dir", metavar="D", help="where learned memory curves are kept")
    serve.set_defaults(run=_serve)

    status = sub.add_parser("status", help="the running daemon's view: host, GPUs, sessions and their plans")
    _endpoint_args(status)
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.set_defaults(run=_status)

    cli_curves.add_parsers(sub, _endpoint_args)

    sample = sub.add_parser("sample", help="take one sample locally (no daemon needed)")
    sample.add_argument("--json", action="store_true", help="machine-readable output")
    sample.add_argument("--pid", type=int, help="also read this process and all its descendants")
    sample.set_defaults(run=_sample)

    doctor = sub.add_parser("doctor", help="what memd can and cannot see here (NVML, PSI, cgroup, /proc, socket)")
    _endpoint_args(doctor)
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.set_defaults(run=_doctor)

    top = sub.add_parser("top", help="live view of the host, GPUs, their processes and sessions (q to leave)")
    _endpoint_args(top)
    top.add_argument("--interval", metavar="S", type=float, default=1.0, help="seconds between redraws")
    top.add_argument("--once", action="store_true", help="print one frame and exit (1 when no daemon answers); "
                     "also what a pipe gets")
    top.add_argument("--sort", metavar="KEY", choices=SORT_KEYS, default="gpu",
                     help="first sort column (keys < and > change it, r reverses): %(choices)s")
    top.set_defaults(run=_top)

    cli_estimate.add_parser(sub)
    cli_call.add_keygen(sub)
    return parser


_endpoint_args = cli_call.add_args


def _exists(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)  # signal 0: asks whether the process exists, sends nothing
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return True


def _serve(args: argparse.Namespace) -> int:
    from memd import config, daemon

    flags = {"endpoint": args.endpoint, "metrics_address": args.metrics_address, "interval": args.interval,
             "state_dir": args.state_dir}

    def load():
        return config.load(args.config, flags=flags)

    return daemon.serve(config.load(args.config, flags=flags, starting=True), reload=load)


def _status(args: argparse.Namespace) -> int:
    try:
        result = _status_of(args)
    except DaemonUnavailable as exc:
        print("memd: %s (is `memd serve` running? --endpoint picks another)" % exc, file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
        return 0
    snap = result.get("snapshot") or {}
    print("memd %s on %s, up %.0f s, pressure %s" % (result.get("version"), result.get("host"),
                                                      result.get("uptime_seconds", 0), result.get("pressure_level")))
    if snap:
        _print_machine(snap)
    sessions = result.get("sessions") or []
    print("\nsessions: %d" % len(sessions))
    if sessions:
        print("  %-20s %7s %5s %-14s %6s %6s %9s %9s  %s" % ("job", "pid", "rank", "pool", "batch", "accum",
                                                            "peak GiB", "budget", "reason"))
    for s in sessions:
        plan = s.get("plan") or {}
        print("  %-20s %7s %5s %-14s %6s %6s %9s %9s  %s" % (
            s["job"][:20], s["pid"], "" if s.get("rank") is None else s["rank"], (s.get("pool") or "")[:14],
            plan.get("batch_size", ""), plan.get("grad_accum_steps", ""), _gib(s.get("latest_peak_bytes")),
            _gib(s.get("budget_bytes")), plan.get("reason", "")))
        for line in (_runs_in(s), _workers_line(s), _cgroup_line(s)):
            if line:
                print("  %20s %s" % ("", line))
    return 0


def _status_of(args: argparse.Namespace) -> dict:
    """The daemon's `status`, every page of its sessions (a reply is bounded: memd.pages)."""
    return cli_call.paged("status", args, "sessions", cli_call.session_number)


_ATTRIBUTED_BY = {"cgroup": "read from its cgroup", "environ": "read from its environment",
                  "client": "as its client said; not checked"}


def _runs_in(s: dict) -> str:
    """"in pod UID, Slurm job N (how memd knows)" for a session attributed to either, else ""."""
    where = []
    if s.get("pod_uid"):
        where.append("Kubernetes pod %s" % s["pod_uid"])
    if s.get("slurm_job_id"):
        where.append("Slurm job %s" % s["slurm_job_id"])
    if not where:
        return ""
    how = _ATTRIBUTED_BY.get(s.get("attributed_by") or "")
    return "in " + ", ".join(where) + (" (%s)" % how if how else "")


def _cgroup_line(s: dict) -> str:
    level = s.get("cgroup_pressure_level") or "ok"
    return "" if level == "ok" else "memory pressure in its own cgroup: %s" % level


def _workers_line(s: dict) -> str:
    """Its dataloader workers as its plan saw them, or "": what a held growth or a cut beside them
    was decided on."""
    w = s.get("workers")
    if not w:
        return ""
    own = w.get("own_bytes") or []
    line = "workers: %d running" % w.get("running", len(own))
    if own:
        line += ", holding %s GiB" % " + ".join(_gib(b) for b in own[:8]) + (" + ..." if len(own) > 8 else "")
    if w.get("cost_bytes"):
        line += ", planned at %s GiB each" % _gib(w["cost_bytes"])
    coming = max(w.get("growth_bytes") or 0, w.get("copying_bytes") or 0)
    if coming:
        line += ", %s GiB more on its way" % _gib(coming)
    if s.get("budget_bytes") is not None and (s.get("pool_budget_bytes") or 0) > s["budget_bytes"]:
        line += "; the batch's budget %s of the job's %s GiB" % (_gib(s["budget_bytes"]), _gib(s["pool_budget_bytes"]))
    return line


def _sample(args: argparse.Namespace) -> int:
    from memd.sampling.sampler import Sampler
    from memd.sampling.snapshot import as_json

    if args.pid is not None and not _exists(args.pid):
        print("memd: no process %d here (--pid)" % args.pid, file=sys.stderr)
        return 1
    sampler = Sampler.default()
    try:
        snap = sampler.sample(pid=args.pid)
    finally:
        sampler.close()
    data = as_json(snap)
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    _print_machine(data)
    if data.get("processes") is not None:
        print("\nprocesses of %d:" % args.pid)
        print("  %7s %7s %-16s %9s %9s %9s %9s" % ("pid", "ppid", "name", "rss MiB", "pss MiB", "uss MiB", "gpu MiB"))
        for p in data["processes"]:
            print("  %7d %7d %-16s %9s %9s %9s %9s" % (
                p["pid"], p["ppid"], p["name"][:16], _mib(p["rss_bytes"]), _mib(p["pss_bytes"]), _mib(p["uss_bytes"]),
                _mib(p["gpu_bytes"])))
    for error in data["errors"]:
        print("  ! %s: %s" % (error["source"], error["message"]))
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from memd.sampling.capabilities import Capability, check_all

    endpoint = cli_call.endpoint(args)
    path = endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else None
    found = check_all(socket_path=path)
    try:
        pong = cli_call.call("ping", args)
        found.append(Capability("daemon", True, "memd %s answers at %s (up %.0f s)" % (
            pong.get("version"), endpoint, pong.get("uptime_seconds", 0))))
    except DaemonUnavailable as exc:
        found.append(Capability("daemon", False, "%s; start it with `memd serve`" % exc))
    if args.json:
        print(json.dumps([c.as_json() for c in found], indent=2))
    else:
        for c in found:
            print("%-12s %-12s %s" % (c.name, "available" if c.available else "unavailable", c.detail))
    return 0


def _top(args: argparse.Namespace) -> int:
    from memd import top, top_screen

    if args.interval <= 0:
        print("memd: --interval must be positive", file=sys.stderr)
        return 2
    return top_screen.run(lambda: _status_of(args), interval=args.interval,
                          once=args.once, unavailable=DaemonUnavailable, view=top.View(sort=args.sort))


def _print_machine(snap: dict) -> None:
    system = snap["system"]
    print("memory model: %s" % snap["memory_model"])
    print("host memory:  %s GiB available of %s GiB (swap %s of %s GiB used)" % (
        _gib(system["available_bytes"]), _gib(system["total_bytes"]), _gib(system["swap_used_bytes"]),
        _gib(system["swap_total_bytes"])))
    psi = snap.get("pressure")
    if psi:
        print("pressure:     some %.1f%% / full %.1f%% (avg10)" % (psi["some_avg10"] * 100, psi["full_avg10"] * 100))
    else:
        print("pressure:     no PSI on this kernel")
    cg = snap.get("cgroup")
    if cg:
        limit = "unlimited" if cg["limit_bytes"] is None else "%s GiB" % _gib(cg["limit_bytes"])
        print("cgroup v%d:    %s, using %s GiB (%s)" % (cg["version"], limit, _gib(cg["usage_bytes"]), cg["path"]))
    for gpu in snap.get("gpus") or []:
        if not gpu["healthy"]:
            print("gpu %d:        %s %s: UNHEALTHY (%s)" % (gpu["index"], gpu["name"] or "?", gpu["uuid"] or "",
                                                             gpu["error"]))
        elif gpu["unified"]:
            print("gpu %d:        %s (unified memory: draws on host RAM)" % (gpu["index"], gpu["name"]))
        else:
            print("gpu %d:        %s, %s GiB used of %s GiB" % (gpu["index"], gpu["name"], _gib(gpu["used_bytes"]),
                                                             _gib(gpu["total_bytes"])))


def _gib(value) -> str:
    return "-" if value is None else "%.2f" % (value / GiB)


def _mib(value) -> str:
    return "-" if value is None else "%.1f" % (value / MiB)
