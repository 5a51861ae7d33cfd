"""A real Prometheus scraping a real memd (fake-driver GPUs, a live training session): every query
of the Grafana dashboard returns data with the labels its legends name, and every alert and
recording rule evaluates in Prometheus without error, with the expected state for the alerts this
test can drive (a training OOM pending, then resolved by the next step; GPU lost, sampling
errors; no headroom alert on a GPU that PyTorch's cache fills; daemon down, restart loop and
sampler stalled stay quiet). Alerts with `for:` durations go pending here; their firing is proven by the promtool
unit tests (prometheus/tests/)."""
import json
import os
import re
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from memd import client
from promtools import ROOT, families, require
from realdaemon import Daemon, free_port

GiB = 2 ** 30
GPUS = """
gpu GPU-11111111-aaaa total=80GiB used=79GiB reserved=512MiB util=97 name=NVIDIA H100 80GB HBM3
gpu GPU-22222222-bbbb total=80GiB used={used} reserved=512MiB util=20 {lost} name=NVIDIA H100 80GB HBM3
proc GPU-22222222-bbbb {pid} 5GiB
{others}
"""
ROOMY = dict(used="8GiB", others="", lost="")
# another process takes the job's GPU: not even the job's min_batch fits what is left
CROWDED = dict(used="79GiB", others="proc GPU-22222222-bbbb 1 74GiB", lost="")
DASHBOARD = os.path.join(ROOT, "grafana", "dashboards", "memd.json")
RULES = os.path.join(ROOT, "prometheus", "memd-rules.yml")
DEADLINE = 25.0  # seconds for everything to show up; typically 3-6


def http_json(url, params=None):
    if params:
        url += "?" + urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:  # Prometheus explains a bad query in the body
        raise AssertionError("%s: %s %s" % (url, e.code, e.read().decode(errors="replace"))) from None


class Prometheus:
    def __init__(self, tmp_path, target):
        self.port = free_port()
        self.url = "http://127.0.0.1:%d" % self.port
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "rule_files: [%s]\n"
            "scrape_configs:\n"
            "  - job_name: memd\n"
            "    static_configs: [{targets: ['%s']}]\n" % (json.dumps(RULES), target))
        self.log_path = tmp_path / "prometheus.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [require("prometheus"), "--config.file=%s" % config, "--storage.tsdb.path=%s" % (tmp_path / "tsdb"),
             "--web.listen-address=127.0.0.1:%d" % self.port, "--storage.tsdb.retention.time=1h"],
            stdout=self._log, stderr=subprocess.STDOUT)

    def log(self):
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_ready(self, deadline):
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("prometheus exited:\n" + self.log())
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError("prometheus not ready:\n" + self.log())

    def query(self, expr):
        reply = http_json(self.url + "/api/v1/query", {"query": expr})
        assert reply["status"] == "success", (expr, reply)
        return reply["data"]["result"]

    def rules(self):
        groups = http_json(self.url + "/api/v1/rules")["data"]["groups"]
        return {r.get("name"): r for g in groups for r in g["rules"]}

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def load_dashboard():
    with open(DASHBOARD) as f:
        return json.load(f)


def dashboard_queries(substitutions):
    """(title, expr, legend) of every panel target and every annotation query, variables filled."""
    dash = load_dashboard()
    names = {v["name"] for v in dash["templating"]["list"]}
    assert {"instance", "gpu"} <= names
    found = [(panel["title"], target["expr"], target.get("legendFormat", ""))
             for panel in dash["panels"] for target in panel.get("targets", [])]
    found += [("annotation " + a["name"], a["expr"], a.get("textFormat", ""))
              for a in dash["annotations"]["list"] if "expr" in a]
    out = []
    for title, expr, legend in found:
        for var, value in substitutions.items():
            expr = expr.replace("$" + var, value)
        assert "$" not in expr, expr
        out.append((title, expr, legend))
    return out


def legend_labels(legend):
    return set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))


def test_dashboard_shows_text_where_text_is_meant_and_up_red_at_zero():
    """The two info stats show their label (not the value 1), "Up" maps 0 to red, the pressure
    level has its own panel (never on an axis with a 0-1 ratio), and OOMs and restarts annotate."""
    panels = {p["title"]: p for p in load_dashboard()["panels"]}
    for title, label in (("Version", "version"), ("Memory model", "model")):
        stat = panels[title]
        assert stat["options"]["textMode"] == "name", title
        assert label in legend_labels(stat["targets"][0]["legendFormat"]), title
    up = panels["Up"]["fieldConfig"]["defaults"]
    assert up["mappings"][0]["options"]["0"]["color"] == "red"
    assert up["thresholds"]["steps"][0] == {"color": "red", "value": None}
    assert [t["expr"] for t in panels["Pressure level"]["targets"]] == ['memd_pressure_level{instance=~"$instance"}']
    for panel in panels.values():  # a 0-1 ratio never shares its panel with the level or seconds with errors/s
        exprs = " ".join(t["expr"] for t in panel.get("targets", []))
        assert not ("memd_pressure_level" in exprs and ":ratio" in exprs), panel["title"]
        assert not ("duration_seconds" in exprs and "errors_total" in exprs), panel["title"]
    annotations = " ".join(a.get("expr", "") for a in load_dashboard()["annotations"]["list"])
    assert "memd_session_ooms_total" in annotations and "memd_start_time_seconds" in annotations


def wait_until(predicate, what, deadline, tick=None):
    while True:
        if tick:
            tick()
        value = predicate()
        if value or time.monotonic() > deadline:
            assert value, "timed out waiting for " + what
            return value
        time.sleep(0.2)


@pytest.fixture
def stack(tmp_path, fake_nvml):
    require("prometheus")
    fake_nvml.write(GPUS.format(pid=os.getpid(), **ROOMY))
    memd = Daemon(tmp_path, metrics=True, env={**fake_nvml.env({}), "MEMD_JOB_INTERVAL": "0.2"}).start()
    prom = Prometheus(tmp_path, memd.metrics_address)
    try:
        yield memd, prom, fake_nvml
    finally:
        prom.stop()
        memd.stop()


def test_dashboard_and_alerts_against_real_prometheus(stack):
    memd, prom, fake = stack
    deadline = time.monotonic() + DEADLINE
    prom.wait_ready(deadline)
    with client.Session("e2e-train", endpoint=memd.endpoint, timeout=1.0, default_batch=8, min_batch=8,
                        target_effective_batch=64, max_batch=64, device="cuda:1") as session:
        session.plan()
        steps = [0]

        def train_step():  # a report per poll keeps sessions, requests and latency moving
            steps[0] += 1
            session.report(batch_size=8, peak_bytes=5 * GiB, step=steps[0], step_seconds=0.2)

        exposed = families(urllib.request.urlopen("http://%s/metrics" % memd.metrics_address,
                                                  timeout=5).read().decode())

        # Every dashboard query returns data, for all instances/GPUs and for one concrete GPU.
        up = wait_until(lambda: prom.query('up{job="memd"} == 1'), "the first scrape", deadline, train_step)
        instance = up[0]["metric"]["instance"]
        queries = dashboard_queries({"instance": ".*", "gpu": ".*", "__rate_interval": "1m"})
        queries += [q for q in dashboard_queries({"instance": instance, "gpu": "GPU-22222222-bbbb",
                                                  "__rate_interval": "30s"}) if "UUID" in q[1] or "pool=~" in q[1]]
        needs_machine, later = [], []
        for title, expr, legend in queries:
            family_names = {re.sub(r"_bucket$", "", n) for n in re.findall(r"\bmemd_[a-z0-9_]+", expr)}
            if not family_names <= set(exposed) or title.startswith("annotation "):
                # PSI or a cgroup counter this kernel lacks; annotations need an event (OOM below)
                prom.query(expr)  # still valid PromQL
                (later if title.startswith("annotation ") else needs_machine).append((title, expr, legend))
                continue
            result = wait_until(lambda: prom.query(expr), "data for dashboard panel %r: %s" % (title, expr),
                                deadline, train_step)
            # every label a legend names is on the series (never `job` for the training job), but
            # those empty (so absent in Prometheus) outside torch.distributed or on a whole GPU
            have = set().union(*(series["metric"] for series in result))
            assert legend_labels(legend) - {"rank", "GPU_I_PROFILE"} <= have, (title, legend, have)
        assert len(needs_machine) <= 3, needs_machine

        # The joins docs/metrics.md shows: valid PromQL; those on memd's series alone return data.
        with open(os.path.join(ROOT, "docs", "metrics.md")) as f:
            examples = re.findall(r"^```promql\n(.*?)\n```", f.read(), re.M | re.S)
        assert len(examples) >= 2
        for expr in examples:
            if "DCGM_" in expr:
                assert prom.query(expr) == []  # no dcgm-exporter here, but Prometheus parses it
            else:
                joined = wait_until(lambda: prom.query(expr), "data for " + expr, deadline, train_step)
                assert {s["metric"]["UUID"] for s in joined} == {"GPU-22222222-bbbb"}  # the session's GPU

        # Every rule loaded and evaluates cleanly.
        rules = wait_until(prom.rules, "rules loaded", deadline)
        alerts = {name: r for name, r in rules.items() if r["type"] == "alerting"}
        assert len(alerts) >= 9 and len(rules) > len(alerts)
        for name, rule in rules.items():
            prom.query(rule["query"])  # through the query API, as the issue asks
            wait_until(lambda: prom.rules()[name]["health"] == "ok",
                       "rule %s healthy: %s" % (name, rule.get("lastError")), deadline)

        # Drive: a training OOM. Unrecovered, MemdTrainingOOM goes pending for its training job
        # (for: 2m); the next completed step handles it and the alert goes quiet again.
        def state(name):
            return prom.rules()[name]["state"]

        deadline = time.monotonic() + DEADLINE  # for the events below, each a scrape and an evaluation away
        session.report_oom(batch_size=8)
        wait_until(lambda: state("MemdTrainingOOM") == "pending", "MemdTrainingOOM pending", deadline)
        oom = prom.query(alerts["MemdTrainingOOM"]["query"])
        assert [s["metric"]["training_job"] for s in oom] == ["e2e-train"]
        train_step()
        wait_until(lambda: state("MemdTrainingOOM") == "inactive", "MemdTrainingOOM resolved", deadline, train_step)
        assert prom.query(alerts["MemdTrainingOOMRepeated"]["query"]) == []  # one OOM is no repetition
        oom_annotation = next((t, e, legend) for t, e, legend in later if t == "annotation Training OOMs")
        marks = wait_until(lambda: prom.query(oom_annotation[1]), "the OOM annotation", deadline)
        assert legend_labels(oom_annotation[2]) <= set(marks[0]["metric"])

        # Another process takes the job's GPU: memd's plan (its min_batch) no longer fits the budget.
        assert prom.query(alerts["MemdTrainingNoHeadroom"]["query"]) == []
        fake.write(GPUS.format(pid=os.getpid(), **CROWDED))
        wait_until(lambda: state("MemdTrainingNoHeadroom") == "pending", "MemdTrainingNoHeadroom pending", deadline,
                   train_step)
        crowded = prom.query(alerts["MemdTrainingNoHeadroom"]["query"])
        assert [(s["metric"]["training_job"], s["metric"]["pool"]) for s in crowded] == [
            ("e2e-train", "GPU-22222222-bbbb")]

        # Then a lost GPU.
        fake.write(GPUS.format(pid=os.getpid(), **dict(CROWDED, lost="fail=lost")))
        wait_until(lambda: state("MemdGpuLost") in ("pending", "firing"), "MemdGpuLost active", deadline)
        lost = prom.query(alerts["MemdGpuLost"]["query"])
        assert {s["metric"]["UUID"] for s in lost} == {"GPU-22222222-bbbb"}
        assert {s["metric"]["pci_bus_id"] for s in lost} == {"00000000:11:00.0"}  # remembered from before
        wait_until(lambda: state("MemdSamplingErrors") in ("pending", "firing"), "MemdSamplingErrors active", deadline)
        assert prom.query(alerts["MemdDown"]["query"]) == [] and state("MemdDown") == "inactive"
        assert prom.query(alerts["MemdAbsent"]["query"]) == [] and state("MemdAbsent") == "inactive"
        assert prom.query(alerts["MemdRestartLoop"]["query"]) == [] and state("MemdRestartLoop") == "inactive"
        assert prom.query(alerts["MemdSamplingStalled"]["query"]) == [] and state("MemdSamplingStalled") == "inactive"
