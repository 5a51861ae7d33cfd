"""The client on its own: import weight, the divisor rule, fallbacks, argument checks."""
import json
import subprocess
import sys
import time

import pytest

from memd import client
from memd.client import identity, suggest
from memd.client.plan import Plan, fallback_plan, make_plan, split_batch
from realdaemon import memd_env


def in_fresh_python(code):
    """``python -c code`` in a new interpreter (what it imports, prints): its completed process."""
    return subprocess.run([sys.executable, "-c", code], env=memd_env(), capture_output=True, text=True, check=True)


def test_import_pulls_in_none_of_the_daemons_dependencies():
    code = ("import sys, json; import memd.client; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('psutil', 'pynvml', 'prometheus_client', 'structlog', 'torch'))))")
    out = in_fresh_python(code)
    assert json.loads(out.stdout) == []


def test_the_plan_record_imports_no_transport():
    """The daemon's pure policy shares memd.client.plan: importing it loads neither pyzmq nor
    msgpack, and not the Session (whose module installs a fork hook)."""
    code = ("import sys, json; import memd.client.plan, memd.client.endpoint; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('zmq', 'msgpack') "
            "or m == 'memd.client.conversation')))")
    out = in_fresh_python(code)
    assert json.loads(out.stdout) == []


def test_every_public_name_is_there_on_first_use():
    code = ("import json; from memd import client; "
            "print(json.dumps([type(getattr(client, n)).__name__ for n in client.__all__ + ['protocol', 'curve']]))")
    out = in_fresh_python(code)
    assert json.loads(out.stdout) == ["type", "type", "function", "function", "function", "function", "type", "type",
                                      "function", "function", "module", "module"]


@pytest.mark.parametrize("limit, target, min_batch, expected", [
    (14, 16, 1, (8, 2)),  # the example: max 14 fits -> 8 x 2
    (24, 16, 1, (16, 1)),
    (16, 16, 1, (16, 1)),
    (63, 64, 1, (32, 2)),
    (50, 96, 1, (48, 2)),
    (5, 7, 1, (1, 7)),  # a prime target: only 1 divides it
    (7, 12, 5, (6, 2)),
    (30, None, 1, (30, 1)),
    (0, 8, 1, (1, 8)),  # nothing fits: the minimum, with accumulation
])
def test_split_batch_keeps_the_effective_batch(limit, target, min_batch, expected):
    batch, steps, note = split_batch(limit, target, min_batch)
    assert (batch, steps) == expected
    if target:
        assert batch * steps == target and note == ""


def test_split_batch_says_when_it_cannot_keep_the_target():
    batch, steps, note = split_batch(5, 7, min_batch=2)  # no divisor of 7 between 2 and 5
    assert batch == 5 and steps == 1 and "effective batch is 5" in note


def _split_batch_before(limit, target, min_batch=1):
    """split_batch as it was before its search was bounded: every divisor listed, the largest kept."""
    limit = max(limit, min_batch, 1)
    if not target or target < min_batch or limit >= target:
        return split_batch(limit, target, min_batch)
    small = [d for d in range(1, int(target ** 0.5) + 1) if target % d == 0]
    fitting = [d for d in small + [target // d for d in small] if min_batch <= d <= limit]
    return (max(fitting), target // max(fitting)) if fitting else None


def test_split_batch_answers_as_before_for_every_small_target():
    for target in range(1, 250):
        for limit in range(0, target + 2):
            for min_batch in (1, 2, 3, 5, 16):
                before = _split_batch_before(limit, target, min_batch)
                batch, steps, note = split_batch(limit, target, min_batch)
                if before is None:
                    assert "no divisor of target %d fits" % target in note
                else:
                    assert (batch, steps) == before[:2], (limit, target, min_batch)


@pytest.mark.parametrize("limit, target, expected", [
    (1000, 2 ** 62, (512, 2 ** 53)),  # listing its divisors took 2 x 10^9 steps (measured 62 s)
    (2 ** 40, 2 ** 62, (2 ** 40, 2 ** 22)),
    (46_000, 2 ** 31 - 1, (1, 2 ** 31 - 1)),  # a prime at the protocol's limit: searched completely
    (10, (2 ** 61 - 1) * 3, (3, 2 ** 61 - 1)),
])
def test_split_batch_is_cheap_for_any_target(limit, target, expected):
    started = time.perf_counter()
    batch, steps, note = split_batch(limit, target)
    assert time.perf_counter() - started < 0.5
    assert (batch, steps, note) == expected + ("",)


def test_split_batch_says_when_a_huge_target_was_not_searched_to_the_end():
    prime = 2 ** 61 - 1  # its only divisors are 1 and itself; proving that takes 10^9 tries
    started = time.perf_counter()
    batch, steps, note = split_batch(2 ** 40, prime, min_batch=2)
    assert time.perf_counter() - started < 0.5
    assert batch == 2 ** 40 and steps == round(prime / 2 ** 40) and "found in" in note and "effective batch is" in note


class _Spec:
    def __init__(self, name):
        self.name = name


class _Main:
    def __init__(self, spec=None):
        self.__spec__ = spec


@pytest.mark.parametrize("argv, spec, orig_argv, expected", [
    (["/home/u/train.py", "--lr", "1"], None, None, "train.py"),  # a script: its file name
    (["/home/u/pkg/train.py"], "pkg.train", None, "pkg.train"),  # python -m pkg.train: the module
    (["/home/u/pkg/__main__.py"], "pkg.__main__", None, "pkg"),  # python -m pkg: the package
    (["-c"], None, ["python3", "-c", "import x; x.train()"], "python-c:"),  # a hash of the command
    (["-c"], None, None, "python-c"),  # Python before 3.10 keeps no copy of the command
    ([""], None, None, "python"),  # the interactive prompt
    (["-"], None, None, "python"),  # a script on stdin
    ([], None, None, "python"),
])
def test_the_default_job_names_the_script_or_module_never_dash_c(argv, spec, orig_argv, expected):
    name = identity.default_job(argv, _Main(_Spec(spec) if spec else None), orig_argv or [])
    assert name.startswith(expected) and (name == expected) == (not expected.endswith(":"))
    assert "-c" != name and len(name) <= 128


def test_one_liners_are_told_apart_and_each_finds_itself_again():
    def name(command):
        return identity.default_job(["-c"], _Main(), ["python", "-X", "dev", "-c", command, "arg"])
    assert name("train(1)") == name("train(1)") != name("train(2)")


def test_the_default_job_of_real_python_c_and_python_m(tmp_path):
    code = "from memd import client; print(client.Session(endpoint='ipc://%s/none').job)" % tmp_path
    ran = in_fresh_python(code)
    assert ran.stdout.strip().startswith("python-c:"), ran.stdout
    (tmp_path / "jobpkg").mkdir()
    (tmp_path / "jobpkg" / "__init__.py").write_text("")
    (tmp_path / "jobpkg" / "train.py").write_text(code + "\n")
    env = memd_env()
    env["PYTHONPATH"] = "%s:%s" % (tmp_path, env["PYTHONPATH"])
    ran = subprocess.run([sys.executable, "-m", "jobpkg.train"], env=env, capture_output=True, text=True,
                         check=True, cwd=str(tmp_path))
    assert ran.stdout.strip() == "jobpkg.train", ran.stdout


def test_fallback_plan_prefers_the_callers_defaults():
    plan = fallback_plan(min_batch=2, max_batch=20, default_batch=32, target_effective_batch=64,
                         hints={"num_workers": 4, "prefetch_factor": 3})
    assert (plan.batch_size, plan.grad_accum_steps, plan.effective_batch_size) == (16, 4, 64)
    assert (plan.num_workers, plan.prefetch_factor, plan.source) == (4, 3, "fallback")
    no_workers = fallback_plan(default_batch=8, hints={"num_workers": 0, "prefetch_factor": 3})
    assert no_workers.prefetch_factor is None  # DataLoader refuses a prefetch_factor without workers


def test_one_constructor_sets_a_plans_derived_fields_on_both_ends():
    """make_plan is the daemon's (controller.decide) and the fallback's way to a Plan."""
    plan = make_plan(6, 3, 0, 2, reason="r", source="daemon", pressure="high", throttle=True, fresh_for=0.25)
    assert (plan.effective_batch_size, plan.prefetch_factor, plan.throttle, plan.fresh_for) == (18, None, True, 0.25)
    assert make_plan(6, 1, 2, 4, reason="r", source="fallback").prefetch_factor == 4
    from memd.config import Config
    from memd.policy.controller import ControlState, Limits, decide
    decided = decide(None, None, Limits(default_batch=12, target=24, num_workers=0, prefetch_factor=3),
                     ControlState(), "ok", Config().policy).plan
    assert (decided.batch_size, decided.grad_accum_steps, decided.effective_batch_size) == (12, 2, 24)
    assert decided.prefetch_factor is None and decided.source == "daemon"


def test_plan_from_wire_rejects_garbage():
    good = fallback_plan(default_batch=8).to_wire()
    assert Plan.from_wire(good).batch_size == 8
    for bad in ({**good, "batch_size": 0}, {**good, "batch_size": "8"}, {**good, "pressure": "meh"},
                {**good, "num_workers": -1}, {**good, "fresh_for": 1e9}, [1, 2], None):
        with pytest.raises(ValueError):
            Plan.from_wire(bad)


def test_bad_arguments_are_programming_errors():
    with pytest.raises(ValueError):
        client.Session("j", min_batch=0, endpoint="ipc:///nonexistent/x.sock")
    with pytest.raises(ValueError):
        client.Session("j", min_batch=8, max_batch=4, endpoint="ipc:///nonexistent/x.sock")
    with pytest.raises(ValueError):
        client.Session("j", min_batch=8, target_effective_batch=4, endpoint="ipc:///nonexistent/x.sock")
    with pytest.raises(TypeError):
        client.Session("j", hints=["not", "a", "dict"], endpoint="ipc:///nonexistent/x.sock")
    with pytest.raises(ValueError, match="target_effective_batch must be at most 2147483647"):
        client.Session("j", target_effective_batch=2 ** 62, endpoint="ipc:///nonexistent/x.sock")
    for bad in (float("nan"), float("inf")):  # a ValueError like any other bad count, not an OverflowError
        with pytest.raises(ValueError, match="max_batch must be a finite count"):
            client.Session("j", max_batch=bad, endpoint="ipc:///nonexistent/x.sock")


BAD_NUMBERS = [float("nan"), float("inf"), float("-inf"), -1, 2 ** 64, 2 ** 63 + 1, "eight", b"8", None, [8], True]


def test_report_never_raises_and_leaves_out_what_the_daemon_would_refuse(caplog):
    """report(peak_bytes=float("nan")) raised before; a huge int was queued and then poisoned
    every later send (msgpack cannot carry it)."""
    s = client.Session("j", endpoint="ipc:///nonexistent/x.sock", timeout=0.01)
    for bad in BAD_NUMBERS:
        s.report(8, peak_bytes=bad, step=bad, step_seconds=bad, batch_bytes=bad)
        s.report(bad, peak_bytes=10 ** 9)  # no usable batch size: the whole report is dropped
    sent = [fields for op, fields in s._pending]
    assert sent == [{"batch_size": 8}] * len(BAD_NUMBERS)
    s.report(8.0, peak_bytes=1.5e9, step=3, step_seconds=0.25, batch_bytes=2 ** 20)  # floats that are numbers: kept
    assert s._pending[-1][1] == {"batch_size": 8, "peak_bytes": 1_500_000_000, "step": 3, "step_seconds": 0.25,
                                 "batch_bytes": 2 ** 20}
    warnings = [r.getMessage() for r in caplog.records if r.name == "memd.client"]
    assert len(warnings) == len(set(warnings)) <= 5  # at most once per field, however often
    assert "report(peak_bytes=nan) left out" in warnings[0]


def test_report_oom_never_raises_and_still_backs_off():
    s = client.Session("j", endpoint="ipc:///nonexistent/x.sock", timeout=0.01, default_batch=16)
    for bad in BAD_NUMBERS:
        s.report_oom(bad)  # an OOM happened all the same: at the batch the job was told, most likely
    assert s._ceiling == 12 and s.plan().batch_size == 12


def test_hints_the_daemon_would_ignore_are_not_sent(caplog):
    s = client.Session("j", endpoint="ipc:///nonexistent/x.sock", num_workers=10 ** 12,
                       hints={"layers": 10 ** 7, "d_model": 768, "mine": float("nan"), "big": 2 ** 70, "note": "x"})
    assert s.hints == {"d_model": 768, "note": "x"}
    assert sum("not sent" in r.getMessage() for r in caplog.records) == 4


def test_suggest_batch_answers_at_once_whatever_the_target(monkeypatch, tmp_path):
    """A target of 2**62 kept the client's own fallback busy for a minute (its divisor search)."""
    import threading

    monkeypatch.setenv("MEMD_ENDPOINT", "ipc://%s/none.sock" % tmp_path)
    monkeypatch.setattr(suggest, "_process_session", None)
    answers = []
    thread = threading.Thread(target=lambda: answers.append(
        client.suggest_batch(default=32, target_effective_batch=2 ** 62, max_batch=64)), daemon=True)
    thread.start()
    thread.join(2.0)
    assert answers == [32]


@pytest.mark.parametrize("default, expected", [("big", 1), (0, 1), (-3, 1), (float("nan"), 1), (True, 1),
                                                (None, 1), (32.0, 32), (2.5, 1)])
def test_suggest_batch_returns_an_int_whatever_its_default(monkeypatch, tmp_path, default, expected, caplog):
    monkeypatch.setenv("MEMD_ENDPOINT", "ipc://%s/absent.sock" % tmp_path)
    monkeypatch.setattr(suggest, "_process_session", None)
    batch = client.suggest_batch(default=default, timeout=0.05)
    assert batch == expected and type(batch) is int
    if expected == 1:
        assert "is not a whole number >= 1; using 1" in caplog.text


def test_suggest_batch_never_raises(monkeypatch, tmp_path):
    monkeypatch.setenv("MEMD_ENDPOINT", "ipc://%s/none.sock" % tmp_path)
    monkeypatch.setattr(suggest, "_process_session", None)
    assert client.suggest_batch(default=32) == 32
    assert client.suggest_batch(default=32, min_batch="bad") == 32


def test_default_endpoint_rules(tmp_path):
    """MEMD_ENDPOINT, else the system socket when it exists, else the per-user one. The system
    socket is named by the test (a file here, then none), so neither branch depends on whether
    this machine runs the memd service."""
    from memd.client import protocol
    system = tmp_path / "run" / "memd.sock"
    assert protocol.default_endpoint({"MEMD_ENDPOINT": "tcp://127.0.0.1:5"}, str(system)) == "tcp://127.0.0.1:5"
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    assert protocol.default_endpoint(env, str(system), euid=1000) == "ipc://%s/memd.sock" % tmp_path
    assert protocol.default_endpoint({}, str(system), euid=1000) == "ipc:///tmp/memd-%d/memd.sock" % (
        __import__("os").getuid())
    # root looks where a daemon run as root binds, there or not yet (issue 14: /tmp/memd-0)
    assert protocol.default_endpoint(env, str(system), euid=0) == "ipc://%s" % system
    system.parent.mkdir()
    system.write_bytes(b"")
    assert protocol.default_endpoint(env, str(system)) == "ipc://%s" % system
    assert protocol.default_endpoint({}, str(system)) == "ipc://%s" % system
    assert protocol.default_endpoint(dict(env, MEMD_ENDPOINT="ipc:///x"), str(system)) == "ipc:///x"
    assert protocol.SYSTEM_SOCKET == "/run/memd/memd.sock"  # the service's (systemd/memd.service)


def test_trim_heap_returns_a_fragmented_heaps_free_pages():
    """Measured on glibc: a batch change leaves the old batch's freed chunks resident; trim_heap
    gives their pages back. 3,000 heap chunks of 64 KiB, every other one freed: RSS stays up
    until the trim, then falls by most of what was freed (~94 MiB)."""
    code = """
import sys
from memd.client import trim_heap
def rss():
    return int(open('/proc/self/statm').read().split()[1]) * 4096
chunks = [bytearray(64 * 1024) for _ in range(3000)]
for c in chunks:
    c[::4096] = b'x' * len(c[::4096])
del chunks[::2]
before = rss()
ok = trim_heap()
print(ok, before - rss())
"""
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's malloc_trim is Linux's")
    out = in_fresh_python(code)
    ok, released = out.stdout.split()
    assert ok == "True" and int(released) > 60 * 2 ** 20


def test_a_change_of_batch_empties_cudas_cache_and_a_step_does_not(monkeypatch):
    """A stand-in for torch in sys.modules (no GPU here; the real one ran on an H200, where the
    kept cache drove the plan 73 -> 1: docs/results.md). trim_heap, called at a change of batch,
    empties the caching allocator once CUDA is set up, and never imports torch itself; the
    trim after each step leaves the cache alone."""
    import types

    from memd.client import heap

    calls, initialized = [], [False]
    cuda = types.SimpleNamespace(is_initialized=lambda: initialized[0], empty_cache=lambda: calls.append("empty"))
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    heap.trim_heap()
    assert calls == []  # torch without CUDA set up: nothing of the GPU's to give back
    initialized[0] = True
    heap.trim_heap()
    assert calls == ["empty"]
    now = [0.0]
    trimmer = heap.StepTrimmer(clock=lambda: now[0])
    for _ in range(3):
        now[0] += 1.0
        trimmer.step_ended()
    assert calls == ["empty"]
    cuda.empty_cache = lambda: 1 / 0  # a broken torch: trim_heap never raises
    assert heap.trim_heap() in (True, False)
    monkeypatch.delitem(sys.modules, "torch")
    heap.trim_heap()
    assert "torch" not in sys.modules


# A fresh interpreter with libc's malloc, free and memset at hand, a Session made, and rss().
HEAP_PREAMBLE = """
import ctypes
from memd.client import Session
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
Session("heap-test", endpoint="ipc:///nonexistent/memd.sock")  # no daemon needed: nothing is sent
def rss():
    return int(open('/proc/self/statm').read().split()[1]) * 4096
"""


def kept_with_and_without_steady_heap(code):
    """What ``code`` prints (bytes kept resident), with the Session's heap held ("1") and left ("0")."""
    kept = {}
    for steady in ("1", "0"):
        env = dict(memd_env(), MEMD_STEADY_HEAP=steady)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        kept[steady] = int(out.stdout)
    return kept


def test_a_session_keeps_the_heap_steady_so_a_step_leaves_nothing_behind():
    """glibc raises its mmap threshold to each large block freed: after a 4 MiB tensor, a step's
    1 MiB tensors come from the heap, and 64 of them freed between others that live on stay
    resident (the next step's peak rides on them). A Session holds the
    threshold at 128 KiB: the same tensors are unmapped when freed. MEMD_STEADY_HEAP=0 opts out."""
    code = HEAP_PREAMBLE + """
first = libc.malloc(4 << 20)  # a first step's large tensor, freed
libc.memset(first, 1, 4 << 20)
libc.free(first)
blocks = [libc.malloc(1 << 20) for _ in range(128)]
for b in blocks:
    libc.memset(b, 1, 1 << 20)
before = rss()
for b in blocks[::2]:  # a step's tensors freed between others that live on
    libc.free(b)
print(rss() - (before - (64 << 20)))
"""
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's mallopt is Linux's")
    kept = kept_with_and_without_steady_heap(code)
    assert kept["0"] > 48 * 2 ** 20, kept  # the mechanism is real here: left alone, the heap keeps them
    assert kept["1"] < 8 * 2 ** 20, kept


def test_a_sessions_forked_workers_give_back_their_per_sample_buffers():
    """A loader worker forked from a Session's process builds each batch from per-sample
    buffers freed once it is collated (the benchmark's: 32 KiB tensors, 64 KiB lists). From the
    heap, those freed between buffers that live on stay resident in the worker: in a 2 GiB cgroup
    four workers' C heaps held 4.8-10.1 MiB each, the loader deciding which. A forked child maps
    blocks of 16 KiB or more, unmapped when freed. MEMD_STEADY_HEAP=0 opts out here too."""
    code = HEAP_PREAMBLE + """
import os
r, w = os.pipe()
pid = os.fork()
if pid == 0:  # the worker
    blocks = [libc.malloc(32 << 10) for _ in range(256)]
    for b in blocks:
        libc.memset(b, 1, 32 << 10)
    before = rss()
    for b in blocks[::2]:  # a batch's samples freed between others that live on
        libc.free(b)
    os.write(w, str(rss() - (before - (4 << 20))).encode())
    os._exit(0)
os.waitpid(pid, 0)
print(os.read(r, 64).decode())
"""
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's mallopt is Linux's")
    kept = kept_with_and_without_steady_heap(code)
    assert kept["0"] > 3 * 2 ** 20, kept  # left alone, the worker's heap keeps the freed samples
    assert kept["1"] < 1 * 2 ** 20, kept


def test_a_step_trims_only_while_that_is_cheap_beside_it():
    """A 1.3 s CPU step and a 20 ms trim (the GPT job's, 1.5 %): trimmed every step. Shorter
    steps, or a trim grown past the session's timeout: trimmed no more."""
    from memd.client.heap import StepTrimmer

    now, trims = [0.0], []

    def trim():
        trims.append(now[0])
        now[0] += cost[0]

    cost = [0.0]
    trimmer = StepTrimmer(share=0.02, limit=0.05, trim=trim, clock=lambda: now[0])
    trimmer.step_ended()  # the first boundary: no step to weigh it against
    for _ in range(3):
        now[0] += 1.3  # a step
        cost[0] = 0.02
        trimmer.step_ended()
    assert len(trims) == 3
    for _ in range(3):
        now[0] += 0.5  # shorter steps: 20 ms is more than 2 % of 0.5 s
        trimmer.step_ended()
    assert len(trims) == 3
    now[0] += 10.0
    cost[0] = 0.2  # a huge heap: 200 ms, under 2 % of a 10 s step, but over the timeout
    trimmer.step_ended()
    now[0] += 10.0
    trimmer.step_ended()
    assert len(trims) == 4


def test_one_stat_parser_for_both_ends():
    """A command name holding spaces and parentheses, a line cut short, and no stat line at all:
    the daemon's sampler and the client's hello read /proc/PID/stat through this one function."""
    from memd.client.procstat import ProcStat, parse_stat

    fields = ["S", "41"] + [str(n) for n in range(2, 19)] + ["123456", "0"]  # utime 11, stime 12
    assert parse_stat("42 (a) (b c)) %s\n" % " ".join(fields)) == ProcStat("a) (b c)", 41, 11 + 12, 123456)
    assert parse_stat("42 (x) S 41 7") == ProcStat("x", 41, None, None)
    for bad in ("", "42 (x) S", "no parentheses"):
        with pytest.raises(ValueError):
            parse_stat(bad)


def test_one_rule_for_whole_numbers():
    """True is an int to Python and a count to nobody: the wire, hints, state files and the
    estimators all ask memd.client.counts."""
    from memd.client.counts import at_least, whole

    assert [whole(v) for v in (0, -3, 2 ** 70, True, False, 1.0, "1", None)] == [True] * 3 + [False] * 5
    assert (at_least(4, 1), at_least(0, 1), at_least(True, 0), at_least(2.0, 0), at_least(None, 0)) == (
        4, None, None, None, None)
