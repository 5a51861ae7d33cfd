"""systemd/: the unit verifies cleanly, its offline security exposure stays <= 2.5, the sysusers
and tmpfiles entries apply to an empty root, the daemon run with the unit's UMask makes a
control socket that members of its group can use, the notify-reload drop-in, Documentation=
after the documented install, and the real daemon's sd_notify messages (READY, STATUS,
RELOADING + MONOTONIC_USEC) and journald priorities, read from a real datagram socket and a
real log file standing in for systemd and journald."""
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import time

import pytest

from memd.client import Session
from promtools import ROOT, require
from realdaemon import Daemon, receive_until, wait_for

UNIT = os.path.join(ROOT, "systemd", "memd.service")
EXEC = "/usr/local/bin/memd"


def unit_settings():
    with open(UNIT) as f:
        return re.findall(r"^(\w+)=(.*)$", f.read(), re.M)


def verifiable_copy(tmp_path):
    """verify insists that ExecStart's binary exists: a copy of the unit whose only change is that
    path, pointing at a stand-in executable (the real one is installed by pip, docs/deploy.md)."""
    stub = tmp_path / "memd"
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    with open(UNIT) as f:
        text = f.read()
    assert text.count(EXEC) == 1
    copy = tmp_path / "memd.service"
    copy.write_text(text.replace(EXEC, str(stub)))
    return copy


def test_unit_verifies_cleanly(tmp_path):
    analyze = require("systemd-analyze")
    out = subprocess.run([analyze, "verify", str(verifiable_copy(tmp_path))], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout + out.stderr == "", out.stdout + out.stderr


def systemd_version(analyze):
    out = subprocess.run([analyze, "--version"], capture_output=True, text=True, timeout=60)
    return int(re.match(r"systemd (\d+)", out.stdout).group(1))


def test_notify_reload_drop_in(tmp_path):
    """With the drop-in beside it (as in /etc/systemd/system/memd.service.d/), the unit verifies
    cleanly on systemd 253 or later; an older systemd's only complaint is the type it does not
    know, which is why docs/deploy.md installs the drop-in only from 253 on."""
    analyze = require("systemd-analyze")
    copy = verifiable_copy(tmp_path)
    drop_ins = tmp_path / "memd.service.d"
    drop_ins.mkdir()
    shutil.copy(os.path.join(ROOT, "systemd", "notify-reload.conf"), str(drop_ins / "notify-reload.conf"))
    out = subprocess.run([analyze, "verify", str(copy)], capture_output=True, text=True, timeout=60)
    said = (out.stdout + out.stderr).strip()
    assert out.returncode == 0, said
    if systemd_version(analyze) >= 253:
        assert said == ""
    else:
        assert re.search(r"notify-reload\.conf:\d+: Failed to parse service type, ignoring: notify-reload$", said), said
        assert len(said.splitlines()) == 1, said


def documented_install():
    """The shell lines of docs/deploy.md's "Install on a node" block."""
    with open(os.path.join(ROOT, "docs", "deploy.md")) as f:
        text = f.read()
    section = text.split("## Install on a node", 1)[1]
    return section.split("```sh", 1)[1].split("```", 1)[0].splitlines()


def test_documentation_is_where_the_documented_install_puts_it(tmp_path):
    """Every file: the unit's Documentation= names is the target of an `install` line of the
    install block, whose source is in the tree; run here under a temporary root."""
    installs = {}
    for line in documented_install():
        words = shlex.split(line, comments=True)
        if words and words[0] == "install":
            source, target = [w for w in words[1:] if not w.startswith("-") and not w.isdigit()][-2:]
            installs[target] = source
    docs = [v for k, v in unit_settings() if k == "Documentation"]
    assert docs
    for uri in " ".join(docs).split():
        assert uri.startswith("file:///"), uri  # no man page or web page is installed
        path = uri[len("file://"):]
        assert path in installs, "no install line puts %s in place" % path
        root = tmp_path / "root"
        (root / path.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(os.path.join(ROOT, installs[path]), str(root / path.lstrip("/")))
        assert (root / path.lstrip("/")).read_text().startswith("# Deploying memd")


def test_unit_security_exposure_is_at_most_2_5():
    analyze = require("systemd-analyze")
    out = subprocess.run([analyze, "security", "--offline=yes", UNIT], capture_output=True, text=True, timeout=60)
    found = re.search(r"Overall exposure level for memd\.service: (\d+\.\d+)", out.stdout)
    assert found, out.stdout + out.stderr
    assert float(found.group(1)) <= 2.5, out.stdout


def test_unit_has_the_operational_contract():
    settings = unit_settings()
    keys = dict(settings)
    assert keys["Type"] == "notify" and keys["Restart"] == "on-failure"
    assert keys["ExecReload"] == "/bin/kill -HUP $MAINPID"  # the fallback before notify-reload (253)
    assert keys["WatchdogSec"] and keys["NoNewPrivileges"] == "yes" and keys["ProtectSystem"] == "strict"
    assert keys["User"] == keys["Group"] == "memd"
    assert keys["RuntimeDirectory"] == keys["StateDirectory"] == "memd"
    assert keys["CapabilityBoundingSet"] == keys["AmbientCapabilities"] == "CAP_SYS_PTRACE"
    assert keys["DevicePolicy"] == "closed"
    assert any(k == "DeviceAllow" and "nvidia" in v for k, v in settings)
    assert int(keys["OOMScoreAdjust"]) < -500 and keys["MemoryMax"]
    assert "--endpoint ipc:///run/memd/memd.sock" in keys["ExecStart"]  # where clients look first


def test_sysusers_and_tmpfiles_apply(tmp_path):
    for tool in ("systemd-sysusers", "systemd-tmpfiles"):
        if shutil.which(tool) is None:
            pytest.skip("%s not found" % tool)
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "passwd").write_text("")
    (tmp_path / "etc" / "group").write_text("")
    out = subprocess.run(["systemd-sysusers", "--root", str(tmp_path),
                          os.path.join(ROOT, "systemd", "memd.sysusers.conf")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert re.search(r"^memd:x:\d+:", (tmp_path / "etc" / "group").read_text(), re.M)
    assert re.search(r"^memd:x:\d+:\d+:.*:/usr/sbin/nologin$", (tmp_path / "etc" / "passwd").read_text(), re.M)
    out = subprocess.run(["systemd-tmpfiles", "--root", str(tmp_path), "--create",
                          os.path.join(ROOT, "systemd", "memd.tmpfiles.conf")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "etc" / "memd").is_dir()


def test_unit_umask_gives_the_group_the_control_socket(tmp_path):
    umask = dict(unit_settings())["UMask"]
    old = os.umask(int(umask, 8))  # inherited by the daemon, as systemd sets it
    try:
        daemon = Daemon(tmp_path).start()
    finally:
        os.umask(old)
    try:
        mode = stat.S_IMODE(os.stat(str(tmp_path / "memd.sock")).st_mode)
        assert mode & 0o060 == 0o060 and mode & 0o007 == 0, oct(mode)
    finally:
        daemon.stop()


# -- the daemon under a stand-in systemd -------------------------------------------------------


def monotonic_usec():
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


def test_daemon_speaks_reload_and_status_to_systemd(tmp_path, notify_socket):
    path, sock = notify_socket
    config = tmp_path / "memd.toml"
    config.write_text("max_sessions = 8\n")
    daemon = Daemon(tmp_path, env={"NOTIFY_SOCKET": path}, args=["--config", str(config)]).start()
    try:
        ready = receive_until(sock, lambda m: m.startswith("READY=1"))[-1]
        assert ready == "READY=1\nSTATUS=0 training sessions, memory pressure ok", ready
        with Session(job="notify-test", endpoint=daemon.endpoint, timeout=2.0) as s:
            s.plan()
            status = receive_until(sock, lambda m: m.startswith("STATUS="))[-1]
            assert status == "STATUS=1 training session, memory pressure ok", status
            for good in (True, False):  # a reload that applies, then one that is refused
                if not good:
                    config.write_text("max_sessions = 'many'\n")
                before = monotonic_usec()
                daemon.proc.send_signal(signal.SIGHUP)
                seen = receive_until(sock, lambda m: m.startswith("READY=1"))
                reloading = [m for m in seen if m.startswith("RELOADING=1")]
                assert len(reloading) == 1, seen
                fields = dict(line.split("=", 1) for line in reloading[0].splitlines())
                assert set(fields) == {"RELOADING", "MONOTONIC_USEC"}
                # systemd (notify-reload) matches the answer to its SIGHUP by this time
                assert before <= int(fields["MONOTONIC_USEC"]) <= monotonic_usec()
                assert seen.index(reloading[0]) < len(seen) - 1  # READY=1 came after it
                assert seen[-1] == "READY=1\nSTATUS=1 training session, memory pressure ok", seen
                assert wait_for(lambda: ("config_reloaded" if good else "reload_refused") in daemon.log())
        status = receive_until(sock, lambda m: m.startswith("STATUS="))[-1]
        assert status == "STATUS=0 training sessions, memory pressure ok"  # the bye is seen
    finally:
        assert daemon.stop() == 0
    assert "STOPPING=1" in receive_until(sock, lambda m: m == "STOPPING=1")


def test_log_lines_carry_journald_priorities(tmp_path):
    """Under systemd, JOURNAL_STREAM names the device and inode of the stdout it connected to
    journald: every line memd writes there starts with its syslog priority (sd-daemon(3)), so
    `journalctl -p err` finds its errors. The daemon's stdout here is a file whose device and
    inode the test passes the same way."""
    log_path = tmp_path / "memd.log"
    log_path.write_text("")
    st = os.stat(str(log_path))
    config = tmp_path / "memd.toml"
    config.write_text("")
    daemon = Daemon(tmp_path, env={"JOURNAL_STREAM": "%d:%d" % (st.st_dev, st.st_ino)},
                    args=["--config", str(config)]).start()
    try:
        with Session(job="journal-test", endpoint=daemon.endpoint, timeout=2.0) as s:
            s.plan()
            s.report_oom(batch_size=8)
        config.write_text("log_level = 'loud'\n")
        daemon.proc.send_signal(signal.SIGHUP)
        assert wait_for(lambda: "reload_refused" in daemon.log())
    finally:
        assert daemon.stop() == 0
    lines = daemon.log().splitlines()
    assert lines and all(re.match(r"<[0-7]>\{", line) for line in lines), lines  # JSON after the prefix

    def priority(event):
        return [line[1] for line in lines if '"event": "%s"' % event in line]

    assert priority("memd_ready") == ["6"] and priority("session_opened") == ["6"]
    assert priority("oom_reported") == ["4"] and priority("session_closed") == ["6"]
    assert priority("reload_refused") == ["3"] and priority("memd_stopped") == ["6"]


def test_no_priority_prefix_off_the_journal(tmp_path):
    """A JOURNAL_STREAM inherited by a process whose stdout went elsewhere (here: another file)
    does not apply: its lines stay plain JSON for whatever reads them."""
    other = tmp_path / "other"
    other.write_text("")
    st = os.stat(str(other))
    daemon = Daemon(tmp_path, env={"JOURNAL_STREAM": "%d:%d" % (st.st_dev, st.st_ino)}).start()
    assert daemon.stop() == 0
    lines = daemon.log().splitlines()
    assert lines and all(line.startswith("{") for line in lines), lines
