"""systemd/: the unit verifies cleanly, its offline security exposure stays <= 2.5, the sysusers
and tmpfiles entries apply to an empty root, and the daemon run with the unit's UMask makes a
control socket that members of its group can use."""
import os
import re
import shutil
import stat
import subprocess

import pytest

from promtools import ROOT, require
from realdaemon import Daemon

UNIT = os.path.join(ROOT, "systemd", "memd.service")
EXEC = "/usr/local/bin/memd"


def unit_settings():
    with open(UNIT) as f:
        return re.findall(r"^(\w+)=(.*)$", f.read(), re.M)


def test_unit_verifies_cleanly(tmp_path):
    analyze = require("systemd-analyze")
    # verify insists that ExecStart's binary exists: check a copy whose only change is that path,
    # pointing at a stand-in executable (the real one is installed by pip, docs/deploy.md).
    stub = tmp_path / "memd"
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    with open(UNIT) as f:
        text = f.read()
    assert text.count(EXEC) == 1
    copy = tmp_path / "memd.service"
    copy.write_text(text.replace(EXEC, str(stub)))
    out = subprocess.run([analyze, "verify", str(copy)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout + out.stderr == "", out.stdout + out.stderr


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
