"""The Prometheus side checked by Prometheus' own tool: rules, their unit tests, the example
configuration, and the exposition of a live daemon (promtool check metrics reports nothing)."""
import glob
import os
import re
import subprocess
import time
import urllib.request

import yaml

from memd import client
from promtools import ROOT, documented_families, families, require
from realdaemon import Daemon

RULES = os.path.join(ROOT, "prometheus", "memd-rules.yml")
RUNBOOKS = "file:///usr/share/doc/memd/deploy.md#"  # the installed docs/deploy.md (memd-rules.yml's header)
RULE_TESTS = sorted(glob.glob(os.path.join(ROOT, "prometheus", "tests", "*.yml")))
GPUS = """
gpu GPU-11111111-aaaa total=80GiB used=10GiB reserved=512MiB util=40 name=NVIDIA H100 80GB HBM3
gpu GPU-22222222-bbbb total=80GiB used=1GiB mig=on name=NVIDIA A100-SXM4-80GB
mig GPU-22222222-bbbb MIG-33333333-cccc total=10GiB used=1GiB name=NVIDIA A100-SXM4-80GB MIG 1g.10gb
"""


def promtool(*args, stdin=None):
    return subprocess.run([require("promtool"), *args], input=stdin, capture_output=True, text=True, timeout=60)


def test_rules_pass_promtool_check():
    out = promtool("check", "rules", RULES)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_rule_unit_tests_pass():
    assert RULE_TESTS
    out = promtool("test", "rules", *RULE_TESTS)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_is_tested_firing_and_not_firing():
    with open(RULES) as f:
        alerts = {r["alert"] for g in yaml.safe_load(f)["groups"] for r in g["rules"] if "alert" in r}
    firing, quiet = set(), set()
    for path in RULE_TESTS:
        with open(path) as f:
            for test in yaml.safe_load(f)["tests"]:
                for check in test.get("alert_rule_test", []):
                    (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    assert alerts - firing == set(), "alerts never tested firing"
    assert alerts - quiet == set(), "alerts never tested quiet"
    required = {"MemdDown", "MemdRestartLoop", "MemdHostMemoryLow", "MemdMemoryPressureWarning",
                "MemdMemoryPressureCritical", "MemdCgroupNearLimit", "MemdTrainingNoHeadroom", "MemdGpuLost",
                "MemdTrainingOOM", "MemdTrainingOOMRepeated", "MemdSamplingErrors"}
    assert required <= alerts


def github_anchors(markdown):
    """The anchors GitHub (and most Markdown renderers) give headings: lower case, punctuation
    other than - and _ dropped, spaces to hyphens."""
    headings = re.findall(r"^#{1,6} (.+?)\s*$", re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_every_alert_links_its_runbook_section_of_deploy_md():
    with open(os.path.join(ROOT, "docs", "deploy.md")) as f:
        anchors = github_anchors(f.read())
    with open(RULES) as f:
        rules = [r for g in yaml.safe_load(f)["groups"] for r in g["rules"] if "alert" in r]
    for rule in rules:
        url = rule["annotations"].get("runbook_url", "")
        assert url.startswith(RUNBOOKS), (rule["alert"], url)
        assert url[len(RUNBOOKS):] in anchors, "%s: no section %r in docs/deploy.md" % (rule["alert"], url)
        assert url[len(RUNBOOKS):] == rule["alert"].lower()  # one section per alert, named by it


def test_every_alert_says_what_to_do():
    with open(RULES) as f:
        for group in yaml.safe_load(f)["groups"]:
            for rule in group["rules"]:
                if "alert" in rule:
                    assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
                    annotations = rule["annotations"]
                    assert annotations["summary"] and len(annotations["description"]) > 80, rule["alert"]


def test_example_config_is_valid():
    out = promtool("check", "config", os.path.join(ROOT, "prometheus", "prometheus.example.yml"))
    assert out.returncode == 0, out.stdout + out.stderr


def test_live_metrics_pass_promtool_check_metrics(tmp_path, fake_nvml):
    promtool_path = require("promtool")
    fake_nvml.write(GPUS)
    daemon = Daemon(tmp_path, metrics=True, env=fake_nvml.env({})).start()
    try:
        with client.Session("lint", endpoint=daemon.endpoint, timeout=1.0, default_batch=8) as s:
            s.plan()
            s.report_oom(batch_size=8)
            s.report(batch_size=6, peak_bytes=2 ** 30)
            deadline = time.monotonic() + 10
            while True:
                text = urllib.request.urlopen("http://%s/metrics" % daemon.metrics_address, timeout=5).read().decode()
                if "memd_session_peak_bytes{" in text or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        out = subprocess.run([promtool_path, "check", "metrics"], input=text, capture_output=True, text=True,
                             timeout=60)
        # The one finding accepted: GPU families carry dcgm-exporter's camelCase label names
        # (UUID, modelName, GPU_I_ID, GPU_I_PROFILE) on purpose, so that they join its series.
        dcgm_names = re.compile(r"^memd_gpu_[a-z_]+ label names should be written in 'snake_case' not 'camelCase'$")
        findings = [line for line in (out.stdout + out.stderr).splitlines() if not dcgm_names.match(line)]
        assert findings == [], out.stdout + out.stderr
        live = families(text)
        assert 'memd_session_ooms_total{' in text and 'training_job="lint"' in text
        mig = re.search(r'^memd_gpu_memory_total_bytes\{([^}]*mig_uuid="MIG-33333333-cccc"[^}]*)\}', text, re.M)
        assert mig and 'UUID="GPU-22222222-bbbb"' in mig.group(1) and 'GPU_I_ID="1"' in mig.group(1), text
        assert 'GPU_I_PROFILE="1g.10gb"' in mig.group(1) and 'modelName="NVIDIA A100-SXM4-80GB"' in mig.group(1)
        assert "process_resident_memory_bytes " in text and "python_info{" in text
        undocumented = set(live) - set(documented_families())
        assert not undocumented, "add these to docs/metrics.md"
        assert all(documented_families()[name] == kind for name, kind in live.items())
    finally:
        daemon.stop()
