"""The real daemon, the real nvidia-ml-py bindings and the real policy over a fake driver
(tests/fakenvml): GPUs in `memd sample` and `memd status`, GPU budgets, lost GPUs, unified
memory, and the watchdog going quiet when a driver call hangs."""
import functools
import json
import os
import socket
import time

import pytest

from memd import client
from nobody import as_nobody
from realdaemon import Daemon, run_memd
from realdaemon import wait_for as _wait_for

GiB = 2 ** 30
TWO_GPUS = """
driver 550.54.15
gpu GPU-11111111-aaaa total=80GiB used=10GiB reserved=512MiB util=40 name=NVIDIA H100 80GB HBM3
gpu GPU-22222222-bbbb total=80GiB used=30GiB reserved=512MiB util=90 name=NVIDIA H100 80GB HBM3
proc GPU-22222222-bbbb {pid} 20GiB
"""
wait_for = functools.partial(_wait_for, timeout=10.0, step=0.05)  # NVML reads are slower


@pytest.fixture
def gpu_memd(tmp_path, fake_nvml):
    fake_nvml.write(TWO_GPUS.format(pid=os.getpid()))
    daemon = Daemon(tmp_path, env={**fake_nvml.env({}), "MEMD_JOB_INTERVAL": "0.1"}).start()
    yield daemon, fake_nvml
    daemon.stop()


def test_a_curve_is_found_again_when_the_jobs_gpu_was_not_known_at_hello(tmp_path, fake_nvml):
    """Two alike GPUs and a job that names neither and is on neither when it says hello (CUDA
    starts after): its curve was looked up under the host's pool (discrete:N) and saved under
    its GPU's once the daemon saw it there, and never found again. Alike GPUs are one kind of
    pool, whichever the job lands on: one key for both."""
    on_no_gpu = TWO_GPUS.split("proc")[0]
    key = "gpu:NVIDIA H100 80GB HBM3:%d" % (80 * GiB)
    fake_nvml.write(on_no_gpu)
    memd = Daemon(tmp_path, env={**fake_nvml.env({}), "MEMD_JOB_INTERVAL": "0.1"}).start()
    try:
        reasons, keys = [], []
        for batches in ((4, 4, 8, 8), (4, 4)):  # this run, then the next after a restart
            with client.Session("alike", endpoint=memd.endpoint, timeout=1.0, default_batch=4, max_batch=4096) as s:
                s.plan()  # hello: on no GPU yet
                fake_nvml.write(TWO_GPUS.format(pid=os.getpid()))  # now on the second
                for batch in batches:  # a warm-up step first, as ever
                    s.report(batch_size=batch, peak_bytes=2 * GiB + batch * GiB)

                def learned():
                    s._plan_expires = 0
                    plan = s.plan()
                    view = next(v for v in memd.call("status")["sessions"] if v["job"] == "alike")
                    return (view, plan) if view["reports"] == len(batches) and view["pool"] == "GPU-22222222-bbbb" \
                        and not plan.reason.startswith("starting") else None  # decided on a sample after the reports

                found = wait_for(learned)
                assert found is not None
                view, plan = found
                reasons.append(plan.reason)
                keys.append(view.get("pool_key"))
            assert wait_for(lambda: not memd.call("status")["sessions"])
            memd.stop()
            assert list(json.loads((tmp_path / "state" / "curves.json").read_text())["jobs"]) == ["alike|" + keys[-1]]
            fake_nvml.write(on_no_gpu)  # the next run's process is on no GPU when it says hello
            memd.start()
        # The second run reported one batch size, 4; its curve is fitted from two, last run's 8
        # with it: its first report agreed with what was remembered.
        assert "from 2 batch sizes" in reasons[1], reasons
        assert keys[0].startswith(key + "#") and keys == [keys[0]] * 2  # then its configuration (max_batch)
    finally:
        memd.stop()


def test_sample_shows_discrete_gpus_with_v2_numbers(fake_nvml):
    fake_nvml.write(TWO_GPUS.format(pid=os.getpid()))
    out = run_memd(["sample", "--json"], env=fake_nvml.env({}))
    data = json.loads(out.stdout)
    assert data["memory_model"] == "discrete"
    first = data["gpus"][0]
    assert (first["uuid"], first["name"], first["total_bytes"]) == (
        "GPU-11111111-aaaa", "NVIDIA H100 80GB HBM3", 80 * GiB)
    assert (first["used_bytes"], first["reserved_bytes"], first["free_bytes"]) == (
        10 * GiB, GiB // 2, 80 * GiB - 10 * GiB - GiB // 2)
    assert first["utilization"] == 0.4 and first["unified"] is False and first["healthy"] is True
    human = run_memd(["sample"], env=fake_nvml.env({}))
    assert "NVIDIA H100" in human.stdout


def test_session_is_budgeted_on_its_own_gpu(gpu_memd):
    memd, _ = gpu_memd
    # A bare CUDA index is ambiguous (CUDA_VISIBLE_DEVICES, ordering): the process NVML sees
    # on a GPU is better evidence, and wins.
    with client.Session("gpu-job", endpoint=memd.endpoint, timeout=1.0, default_batch=8, device="cuda:0") as s:
        s.plan()
        for _ in range(2):  # a warm-up step, then one the curve learns from
            s.report(batch_size=8, peak_bytes=18 * GiB)
        # Found by its process on GPU 2; budget = free 49.5 + min(own 20, peak 18) - 1 % margin,
        # once the daemon has read the job's processes (until then it counts only what the job
        # had reported before the snapshot it decides on: nothing, so a smaller budget).
        margin = int(80 * GiB * 0.01)
        expected = int(49.5 * GiB) + 18 * GiB - margin

        def view():
            s._plan_expires = 0
            s.plan()
            found = next(v for v in memd.call("status")["sessions"] if v["job"] == "gpu-job")
            return found if found["reports"] == 2 and found["budget_bytes"] == expected else None

        view = wait_for(view)
        assert view is not None
        assert view["pool"] == "GPU-22222222-bbbb"
        assert view["predicted_peak_bytes"] <= view["budget_bytes"]
        assert view["plan"]["batch_size"] == int(8 * view["budget_bytes"] / (18 * GiB))


@pytest.mark.parametrize("sampled_between", [False, True], ids=["at-once", "sampled-between"])
def test_a_base_above_the_reported_peaks_does_not_flatten_the_curve(gpu_memd, sampled_between):
    """Memory held between steps (base_bytes) above every reported peak is not in the peaks'
    units (it counts the CUDA context, or the whole process): taken as it was, it flattened the
    line, and a job whose reports 8 and 16 fit was planned 1,048,576 samples. The same end
    whether the daemon decides on all the reports at once or first on the steps at 8 alone (a
    sample of the machine fell between: planned 105, counting all of their memory as the samples')."""
    memd, _ = gpu_memd
    # Over the wire (the Python client sends no base): this process, which the driver shows on GPU 2
    token = memd.call("hello", job="based", pid=os.getpid(), host=socket.gethostname(), default_batch=8)["token"]
    sent = []

    def step(batch):  # a step's report: on the line 2 GiB + 0.25 GiB a sample, its base above every peak
        memd.call("report", token=token, batch_size=batch, peak_bytes=2 * GiB + batch * GiB // 4, base_bytes=40 * GiB)
        sent.append(batch)

    def planned():  # decided on every report, on its GPU (the daemon reads the driver every 0.1 s)
        plan = memd.call("plan", token=token)["plan"]
        found = next(v for v in memd.call("status")["sessions"] if v["job"] == "based")
        return (found, plan) if found["pool"] == "GPU-22222222-bbbb" and found["reports"] == len(sent) \
            and plan["batch_size"] > 16 else None

    for batch in (8, 8, 8):  # a warm-up step, then a batch size
        step(batch)
    if sampled_between:
        assert wait_for(lambda: memd.call("plan", token=token)["plan"]["batch_size"] > 8)
    for batch in (16, 16):  # and a second
        step(batch)
    # Then the batch planned, as a training loop runs it, until the plan is one it has run twice: a
    # new plan waits for two steps at its batch before it grows, and a job that never ran the 105
    # was left there where the line gives 202. (Each step's peak is on the line; the plan may move
    # again as the daemon learns what the job holds on its GPU.)
    for _ in range(6):
        found = wait_for(planned)
        assert found is not None
        if sent[-2:] == [found[1]["batch_size"]] * 2:
            break
        step(found[1]["batch_size"])
        step(found[1]["batch_size"])
    view, plan = found
    assert sent[-2:] == [plan["batch_size"]] * 2, (plan, sent)  # settled where it ran
    # The line through the peaks, 2 GiB + 0.25 GiB a sample, in the budget, less the spread the
    # curve allows for a GPU's peaks; never more (the base taken as it was: 1,048,576)
    line = (view["budget_bytes"] - 2 * GiB) // (GiB // 4)
    assert 0.8 * line <= plan["batch_size"] <= line, (plan, view, sent)
    memd.call("bye", token=token)


def test_status_shows_gpus_and_survives_a_lost_gpu(gpu_memd):
    memd, fake = gpu_memd
    gpus = memd.call("status")["snapshot"]["gpus"]
    assert [g["uuid"] for g in gpus] == ["GPU-11111111-aaaa", "GPU-22222222-bbbb"]
    # pid attribution: the 20 GiB process is this test process, on the second GPU only
    assert [(p["pid"], p["used_bytes"]) for p in gpus[1]["processes"]] == [(os.getpid(), 20 * GiB)]
    assert gpus[0]["processes"] == []
    fake.write(TWO_GPUS.format(pid=os.getpid()).replace("util=40", "util=40 fail=lost"))
    lost = wait_for(lambda: not memd.call("status")["snapshot"]["gpus"][0]["healthy"]
                    and memd.call("status")["snapshot"])
    assert lost["gpus"][0]["uuid"] == "GPU-11111111-aaaa"  # still named after it was lost
    assert lost["gpus"][1]["healthy"] and lost["gpus"][1]["used_bytes"] == 30 * GiB
    assert any(e["source"] == "nvml" for e in lost["errors"])
    assert lost["memory_model"] == "discrete"
    out = run_memd(["status", "--endpoint", memd.endpoint])
    assert "UNHEALTHY" in out.stdout


def test_a_session_whose_gpu_is_lost_holds_its_batch(gpu_memd):
    memd, fake = gpu_memd
    with client.Session("lost-gpu", endpoint=memd.endpoint, timeout=1.0, default_batch=8, device="cuda:0") as s:
        s.plan()
        s.report(batch_size=8, peak_bytes=18 * GiB)
        view = wait_for(lambda: next(v for v in memd.call("status")["sessions"]
                                     if v["job"] == "lost-gpu")["reports"] == 1
                        and next(v for v in memd.call("status")["sessions"] if v["job"] == "lost-gpu"))
        assert view["pool"] == "GPU-22222222-bbbb"
        before = view["plan"]["batch_size"]
        fake.write("driver 550.54.15\n")  # every GPU gone: the machine now looks like cpu
        wait_for(lambda: memd.call("status")["snapshot"]["memory_model"] == "cpu")
        s.report(batch_size=before, peak_bytes=18 * GiB * before // 8)
        held = wait_for(lambda: "cannot be read" in (s.plan().reason or "") and s.plan())
        assert held.batch_size == before  # not re-budgeted from host RAM
        assert "GPU-22222222-bbbb" in held.reason
        fake.write(TWO_GPUS.format(pid=os.getpid()))  # back: budgeted on its GPU again
        back = wait_for(lambda: "cannot be read" not in s.plan().reason and s.plan())
        assert back.source == "daemon" and "cannot be read" not in back.reason


def test_not_supported_memory_makes_the_machine_unified(tmp_path, fake_nvml):
    fake_nvml.write("gpu GPU-33333333-cccc memory=not_supported name=NVIDIA GB10\n")
    daemon = Daemon(tmp_path, env=fake_nvml.env({})).start()
    try:
        snap = daemon.call("status")["snapshot"]
        assert snap["memory_model"] == "unified"
        assert snap["gpus"][0]["unified"] is True and snap["gpus"][0]["total_bytes"] is None
        token = daemon.call("hello", job="spark", pid=os.getpid(), host=socket.gethostname())["token"]
        daemon.call("report", token=token, batch_size=4, peak_bytes=GiB)
        view = daemon.call("status")["sessions"][0]
        assert view["pool"] == "host"  # GPU and CPU draw on one pool
    finally:
        daemon.stop()


def test_daemon_measures_gpu_peak_when_not_told(gpu_memd):
    memd, _ = gpu_memd
    token = memd.call("hello", job="measured", pid=os.getpid(), host=socket.gethostname())["token"]
    memd.call("plan", token=token)
    # Wait until the daemon has read this job's tree and attributed its GPU memory.
    time.sleep(0.3)
    memd.call("report", token=token, batch_size=8)  # peak_bytes absent: measure it
    view = next(v for v in memd.call("status")["sessions"] if v["job"] == "measured")
    assert view["latest_peak_bytes"] == 20 * GiB  # what NVML attributes to this process


def test_hung_sampler_stops_watchdog_pings(tmp_path, fake_nvml):
    notify_path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(notify_path)
    sock.settimeout(0.05)
    fake_nvml.write("gpu GPU-44444444-dddd total=16GiB used=1GiB name=Tesla T4\n")
    daemon = Daemon(tmp_path, env={**fake_nvml.env({}), "NOTIFY_SOCKET": notify_path,
                                    "WATCHDOG_USEC": "200000"}).start()
    try:
        def pings(seconds):
            count, deadline = 0, time.monotonic() + seconds
            while time.monotonic() < deadline:
                try:
                    count += sock.recv(100) == b"WATCHDOG=1"
                except socket.timeout:
                    pass
            return count

        assert pings(1.0) >= 3  # healthy: every 100 ms
        fake_nvml.write("gpu GPU-44444444-dddd total=16GiB used=1GiB hang=4000 name=Tesla T4\n")
        time.sleep(2.5)  # the sampler is stuck in the driver; its heartbeat goes stale after 2 s
        pings(0.1)  # drop the pings sent before it went stale
        assert pings(1.0) == 0
        assert daemon.call("ping")["pong"] is True  # requests are still answered meanwhile
        fake_nvml.write("gpu GPU-44444444-dddd total=16GiB used=1GiB name=Tesla T4\n")
        assert wait_for(lambda: pings(0.5) >= 1, timeout=10)  # the sampler recovered: pings resume
    finally:
        daemon.stop()
        sock.close()


def test_doctor_names_every_capability(fake_nvml, tmp_path):
    bare = json.loads(run_memd(["doctor", "--json", "--endpoint", "ipc://%s/none.sock" % tmp_path]).stdout)
    by_name = {c["name"]: c for c in bare}
    assert set(by_name) == {"nvml", "platform", "psi", "cgroup", "proc_access", "socket", "daemon"}
    assert by_name["nvml"]["available"] is False and "libnvidia-ml.so.1" in by_name["nvml"]["detail"]
    assert by_name["daemon"]["available"] is False and "memd serve" in by_name["daemon"]["detail"]
    assert by_name["psi"]["available"] is os.path.exists("/proc/pressure/memory")
    fake_nvml.write(TWO_GPUS.format(pid=os.getpid()))
    human = run_memd(["doctor", "--endpoint", "ipc://%s/none.sock" % tmp_path], env=fake_nvml.env({}))
    assert human.returncode == 0
    nvml_line = [line for line in human.stdout.splitlines() if line.startswith("nvml")][0]
    assert "available" in nvml_line and "unavailable" not in nvml_line and "2 GPUs" in nvml_line


def test_doctor_says_when_other_users_processes_are_unreadable():
    if os.geteuid() != 0:
        pytest.skip("needs root to become another user")
    from memd.sampling.capabilities import check_proc_access

    def look():  # as nobody, at root's processes
        c = check_proc_access()
        return [c.available, c.detail]

    available, detail = as_nobody(look)
    assert available is False and "CAP_SYS_PTRACE" in detail
    mine = check_proc_access()
    assert mine.available is True


def test_two_sessions_on_one_gpu_never_plan_past_it_together(tmp_path, fake_nvml):
    """Two jobs share an 80 GiB GPU (another tenant holds 10 GiB). Each step holds what its peak
    was (the caching allocator keeps it, NVML shows it); their plans together must always fit."""
    total, others = 80 * GiB, 10 * GiB
    curves = {"a": (4 * GiB, GiB // 2), "b": (6 * GiB, GiB)}  # fixed + per sample
    held = {"a": 0, "b": 0}

    def show():
        used = others + sum(held.values())
        fake_nvml.write("gpu GPU-55555555-eeee total=80GiB used=%d name=NVIDIA H100 80GB HBM3\n" % used)

    show()
    daemon = Daemon(tmp_path, env={**fake_nvml.env({}), "MEMD_JOB_INTERVAL": "0.1"}).start()
    sessions = {job: client.Session(job, endpoint=daemon.endpoint, timeout=1.0, default_batch=4) for job in curves}
    try:
        worst = 0
        for _ in range(12):
            planned = {}
            for job, s in sessions.items():
                s._plan_expires = 0  # ask the daemon every step
                plan = s.plan()
                assert plan.source == "daemon"
                planned[job] = plan.batch_size
            peaks = {job: curves[job][0] + curves[job][1] * b for job, b in planned.items()}
            worst = max(worst, sum(peaks.values()))
            assert others + sum(peaks.values()) <= total, (planned, peaks)  # no OOM, ever
            for job, s in sessions.items():
                held[job] = max(held[job], peaks[job])
                s.report(batch_size=planned[job], peak_bytes=peaks[job])
            show()
            time.sleep(0.15)  # a sample or two of the device after the step
        # Both want more than half: each gets about half (not first come, first served), and
        # together they use most of what is free.
        assert min(peaks.values()) >= 0.4 * (total - others), (planned, peaks)
        assert worst >= 0.8 * (total - others), (planned, worst / GiB)
    finally:
        for s in sessions.values():
            s.close()
        daemon.stop()


def test_an_out_of_memory_error_keeps_the_budget_until_the_next_report(tmp_path, fake_nvml):
    """No per-process memory on this GPU (a container): the daemon pairs free memory with what
    the job reported holding. After an OOM the job's cache holds an unknown amount (here nearly
    the whole device): the budget paired before stands, and the plan is the OOM cut, not a
    collapse to what the device's last free gigabytes allow."""
    one_gpu = ("driver 550.54.15\n"
               "gpu GPU-33333333-cccc total=80GiB used={used}GiB reserved=0 name=NVIDIA H100 80GB HBM3\n")
    fake_nvml.write(one_gpu.format(used=20))
    daemon = Daemon(tmp_path, env={**fake_nvml.env({}), "MEMD_JOB_INTERVAL": "0.1"}).start()
    try:
        with client.Session("oom-gpu", endpoint=daemon.endpoint, timeout=1.0, default_batch=8, device="cuda:0") as s:
            s.plan()
            for _ in range(3):
                s.report(batch_size=8, peak_bytes=18 * GiB)

            def view():
                s._plan_expires = 0
                s.plan()  # the daemon decides again on the samples it has taken since
                return next(v for v in daemon.call("status")["sessions"] if v["job"] == "oom-gpu")

            assert wait_for(lambda: view()["reports"] == 3 and view()["budget_bytes"] > 70 * GiB)
            budget, grown = view()["budget_bytes"], view()["plan"]["batch_size"]
            assert grown > 8
            fake_nvml.write(one_gpu.format(used=79))  # the failed step's blocks stay in the job's cache
            time.sleep(0.3)  # the daemon samples the full device
            s.report_oom(batch_size=grown)
            after = view()
            assert after["budget_bytes"] == budget
            assert after["plan"]["batch_size"] == int(grown * 0.75), after["plan"]["reason"]
    finally:
        daemon.stop()


UNLIKE_GPUS = """
driver 550.54.15
gpu GPU-11111111-aaaa total=80GiB used=1GiB reserved=512MiB util=0 name=NVIDIA H100 80GB HBM3
gpu GPU-33333333-cccc total=40GiB used=1GiB reserved=512MiB util=0 name=NVIDIA A100-SXM4-40GB
"""


def test_a_job_whose_gpu_cannot_be_told_keeps_its_default_until_it_can(tmp_path, fake_nvml):
    """Two unlike GPUs, a job that names neither and uses neither yet: no budget from the host's
    RAM (which its hints would have turned into a batch in the thousands), its default and a
    reason that says why, even after its reports; once its process is on a GPU, that GPU plans
    it. A job that says it trains on the CPU is planned from host RAM."""
    fake_nvml.write(UNLIKE_GPUS)
    memd = Daemon(tmp_path, env={**fake_nvml.env({}), "MEMD_JOB_INTERVAL": "0.1"}).start()
    try:
        hints = {"fixed_bytes": 2 * GiB, "per_sample_bytes": GiB // 8}
        s = client.Session("untold", endpoint=memd.endpoint, timeout=1.0, default_batch=8, hints=hints)
        with s:
            plan = s.plan()
            assert plan.batch_size == 8 and "which GPU this job runs on is not known yet" in plan.reason, plan
            for batch in (8, 8, 8):
                s.report(batch_size=batch, peak_bytes=3 * GiB)
            assert wait_for(lambda: next(v for v in memd.call("status")["sessions"])["reports"] == 3)
            s._plan_expires = 0
            plan = s.plan()
            assert plan.batch_size == 8 and "not known yet" in plan.reason, plan
            assert memd.call("status")["sessions"][0]["pool_key"] is None
            on_a100 = UNLIKE_GPUS.replace("total=40GiB used=1GiB", "total=40GiB used=4GiB")
            fake_nvml.write(on_a100 + "proc GPU-33333333-cccc %d 3GiB\n" % os.getpid())  # CUDA starts on the A100

            def on_gpu():
                s._plan_expires = 0
                reason = s.plan().reason  # decided on the latest sample, which status then shows
                view = memd.call("status")["sessions"][0]
                return view if view["pool"] == "GPU-33333333-cccc" and "not known" not in reason else None

            view = wait_for(on_gpu)
            assert view is not None and view["pool_key"].startswith("gpu:NVIDIA A100-SXM4-40GB:%d#" % (40 * GiB)), view
            assert view["budget_bytes"] < 40 * GiB  # the A100's room, not the host's
        with client.Session("on-cpu", endpoint=memd.endpoint, timeout=1.0, default_batch=8, hints=hints,
                            device="cpu") as cpu:
            plan = cpu.plan()
            assert "not known" not in plan.reason and "prior estimate" in plan.reason, plan
    finally:
        memd.stop()
