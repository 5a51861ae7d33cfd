"""Real training on a real GPU: the largest batch that fits in what another tenant leaves free,
memd beside the peers.

    python bench/gpujobs.py [--free-gib 16] [--steps 60] [--out DIR] [--log-reads]

bench/realjobs.py's row on a discrete GPU: the same probes, methods, table and plot. A tenant
process takes all of the GPU's memory but --free-gib (another job on a shared device), and each
job trains the GPT-style model at GPU scale in what is left (bench/trainjob.py --shape gpt-gpu
--device cuda), its CUDA context included. What differs from a cgroup: nothing kills. A batch
that does not fit raises CUDA's out-of-memory error, which the peers catch and act on and a loop
that does not catch dies of; a probe that raises it does not fit. memd learns a step's peak from
the job's report (torch.cuda.max_memory_reserved(), as README shows) or, for suggest_batch()
alone, from NVML: what the driver says the job's process holds on its GPU.

Writes DIR/results.json (with the tenant's hold and memd's own view of the GPU, read through
NVML while only the tenant ran), DIR/table.md and DIR/ROW.png.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "client")]

from bench.realjobs import GiB, MEMD_METHODS, PEER_METHODS, MemdDaemon, Row, bench_row, machine_meta, plot, \
    write_table  # noqa: E402

# The tenant: all of the device's free memory but what the row leaves, held until its stdin closes.
TENANT = """
import json, sys, torch
free, total = torch.cuda.mem_get_info()
held = torch.empty(max(0, free - int(sys.argv[1])), dtype=torch.uint8, device="cuda")
left, _ = torch.cuda.mem_get_info()
print(json.dumps({"pid": __import__("os").getpid(), "held_bytes": held.numel(), "free_bytes": left,
                  "total_bytes": total}), flush=True)
sys.stdin.read()
"""


class Tenant:
    """Another process on the GPU, holding all of its memory but ``leave_bytes``."""

    def __init__(self, leave_bytes: int):
        self.proc = subprocess.Popen([sys.executable, "-c", TENANT, str(leave_bytes)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(30)
            raise RuntimeError("the tenant could not take the GPU's memory (exit %s)" % self.proc.returncode)
        self.held = json.loads(line)

    def stop(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def memd_view(endpoint: str) -> list:
    """The GPUs as the daemon sees them through NVML (its latest sample), for the record."""
    from memd.client import call

    snapshot = call("status", endpoint=endpoint, timeout=5.0).get("snapshot") or {}
    return snapshot.get("gpus") or []


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--free-gib", type=float, default=16.0, help="GPU memory the tenant leaves to the jobs")
    parser.add_argument("--methods", default=",".join(m for m in MEMD_METHODS + PEER_METHODS if m != "loader"))
    parser.add_argument("--steps", type=int, default=60, help="training steps per method run")
    parser.add_argument("--probe-steps", type=int, default=5, help="steps per probing run")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a method's run may take")
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "gpu"))
    parser.add_argument("--log-reads", action="store_true",
                        help="DIR/reads/<row>-<method>.jsonl: memd's view of each method's job every half "
                             "second (its budget, predicted peak, measured peak and plan's reason)")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpujobs: PyTorch sees no CUDA device here", file=sys.stderr)
        return 2
    methods = args.methods.split(",")
    if "loader" in methods:
        parser.error("--methods: MemdLoader's workers job trains on the CPU (bench/realjobs.py)")
    import bench.realjobs as realjobs
    realjobs.RUN_TIMEOUT = args.timeout
    row = Row("gpt-gpu-%gg" % args.free_gib, "gpt-gpu", int(args.free_gib * GiB), 4, device="cuda")
    os.makedirs(args.out, exist_ok=True)
    log = lambda text: print(text, flush=True)  # noqa: E731
    meta = dict(command="python bench/gpujobs.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                **machine_meta(), gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda,
                date=time.strftime("%Y-%m-%d"), steps=args.steps, probe_steps=args.probe_steps)
    tenant = Tenant(row.limit_bytes)
    daemon = None
    try:
        log("tenant pid %d holds %.2f GiB of %.2f; %.2f GiB free" % (
            tenant.held["pid"], tenant.held["held_bytes"] / GiB, tenant.held["total_bytes"] / GiB,
            tenant.held["free_bytes"] / GiB))
        daemon = MemdDaemon()
        time.sleep(1.0)  # a few samples
        view = memd_view(daemon.endpoint)
        for gpu in view:
            log("memd sees %s: %.2f GiB total, %.2f used, processes %s" % (
                gpu.get("name"), (gpu.get("total_bytes") or 0) / GiB, (gpu.get("used_bytes") or 0) / GiB,
                [(p["pid"], round((p.get("used_bytes") or 0) / GiB, 2)) for p in gpu.get("processes") or []]))
        reads = os.path.join(args.out, "reads") if args.log_reads else None
        if reads:
            os.makedirs(reads, exist_ok=True)
        result = bench_row(row, methods, args.steps, args.probe_steps, daemon, log, reads=reads)
        for run in result["runs"]:
            run["commit"] = meta["commit"]
        result.update(tenant=tenant.held, memd_view=view)
        plot(result, os.path.join(args.out, "%s.png" % row.name))
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"meta": meta, "results": [result]}, f, indent=1)
    finally:
        if daemon is not None:
            daemon.stop(keep_log=os.path.join(args.out, "memd.log"))
        tenant.stop()
    return write_table([result], args.out)


if __name__ == "__main__":
    sys.exit(main())
