"""deploy/kubernetes/: the manifests (base/, and the node-jobs/ overlay rendered) validate
against Kubernetes' schemas (kubernetes-validate, strict), checkov finds nothing but the
findings they accept (each with its reason, and each still a finding without its skip), the
pieces agree with each other and with the docs' training-pod example, and the container's
command and probes work against the real daemon. kubernetes-validate and checkov are not in
the [test] extra (108 MB of schemas; checkov pins packaging<24, which pytest refuses): locally
a missing one skips, under CI (.ci/run installs both) it fails."""
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest
import yaml

from promtools import ROOT
from realdaemon import free_port, memd_env, run_memd

K8S = os.path.join(ROOT, "deploy", "kubernetes")
BASE = os.path.join(K8S, "base")
OVERLAY = os.path.join(K8S, "node-jobs")
SOCKET_DIR = "/run/memd"


def tool(name):
    """The executable, on PATH or beside this Python's (the venv's bin)."""
    path = shutil.which(name) or shutil.which(name, path=os.path.dirname(sys.executable))
    if path is None:
        message = "%s not found: pip install kubernetes-validate checkov (into a venv of their own)" % name
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message + "; CI must install it (.ci/run does)")
        pytest.skip(message)
    return path


def load(name, directory=BASE):
    with open(os.path.join(directory, name)) as f:
        return yaml.safe_load(f)


def resources():
    return load("kustomization.yaml")["resources"]


def by_kind():
    return {doc["kind"]: doc for doc in map(load, resources() + ["servicemonitor.yaml"])}


def merge(base, patch):
    """kustomize's strategic merge, as far as the overlay's patch uses it: maps merge, lists
    of named maps (containers) merge by name, other lists are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            out[key] = merge(base[key], value) if key in base else value
        return out
    if isinstance(base, list) and isinstance(patch, list) and all(isinstance(x, dict) and "name" in x
                                                                 for x in base + patch):
        named = {x["name"]: x for x in patch}
        return [merge(x, named.pop(x["name"])) if x["name"] in named else x for x in base] + list(named.values())
    return copy.deepcopy(patch)


def rendered_overlay():
    """The node-jobs overlay as kustomize renders it (checked against `kubectl kustomize` where
    kubectl is installed)."""
    overlay = load("kustomization.yaml", OVERLAY)
    assert overlay["resources"] == ["../base"]
    (patch,) = [load(p["path"], OVERLAY) for p in overlay["patches"]]
    docs = []
    for doc in (load(name) for name in resources()):
        same = (doc["kind"], doc["metadata"]["name"]) == (patch["kind"], patch["metadata"]["name"])
        docs.append(merge(doc, patch) if same else doc)
    return docs


def test_overlay_renders_as_kubectl_does():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not found: the overlay's rendering is checked against kubectl kustomize where it is")
    out = subprocess.run([kubectl, "kustomize", OVERLAY], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    assert sorted(yaml.safe_load_all(out.stdout), key=key) == sorted(rendered_overlay(), key=key)


def test_kustomization_lists_every_manifest_but_the_operators():
    manifests = sorted(f for f in os.listdir(BASE) if f.endswith(".yaml") and f != "kustomization.yaml")
    assert sorted(resources() + ["servicemonitor.yaml"]) == manifests


def write_overlay(directory):
    directory.mkdir()
    path = directory / "node-jobs.yaml"
    path.write_text(yaml.safe_dump_all(rendered_overlay()))
    return path


def test_manifests_validate_strictly(tmp_path):
    validate = tool("kubernetes-validate")
    files = [os.path.join(BASE, name) for name in resources()] + [str(write_overlay(tmp_path / "overlay"))]
    out = subprocess.run([validate, "--strict", "--quiet"] + files, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ERROR" not in out.stdout + out.stderr, out.stdout + out.stderr
    # the check can fail: a misspelt field is refused
    broken = tmp_path / "daemonset.yaml"
    with open(os.path.join(BASE, "daemonset.yaml")) as f:
        broken.write_text(f.read().replace("readOnlyRootFilesystem:", "readOnlyRootFileSystem:"))
    out = subprocess.run([validate, "--strict", "--quiet", str(broken)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "readOnlyRootFileSystem" in out.stdout + out.stderr


def checkov(directory, exclude=None):
    command = [tool("checkov"), "-d", str(directory), "--compact", "--skip-download", "-o", "json",
               "--framework", "kubernetes", "dockerfile"] + (["--skip-path", exclude] if exclude else [])
    out = subprocess.run(command, capture_output=True, text=True, timeout=300, env=dict(os.environ, LOG_LEVEL="ERROR"))
    reports = json.loads(out.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    failed = {(r["check_type"], c["check_id"]) for r in reports for c in r["results"]["failed_checks"]}
    skipped = {(r["check_type"], c["check_id"]) for r in reports for c in r["results"]["skipped_checks"]}
    return failed, skipped


BASE_ACCEPTED = {"CKV_K8S_23", "CKV_K8S_40", "CKV_K8S_43"}
OVERLAY_ACCEPTED = BASE_ACCEPTED | {"CKV_K8S_17", "CKV_K8S_19", "CKV_K8S_25"}
SKIP = re.compile(r"(?m)^ *checkov\.io/skip\d+: (CKV_\w+)=(.+)\n")


def without_skips(directory, text):
    """A copy of the scanned manifests without checkov's skip annotations."""
    directory.mkdir()
    shutil.copy(os.path.join(BASE, "networkpolicy.yaml"), str(directory))  # else: another finding
    docs = [doc for doc in yaml.safe_load_all(text) if doc["kind"] == "DaemonSet"]
    for doc in docs:
        doc["metadata"]["annotations"] = {k: v for k, v in doc["metadata"]["annotations"].items()
                                          if not k.startswith("checkov.io/skip")}
    (directory / "daemonset.yaml").write_text(yaml.safe_dump_all(docs))
    return directory


def test_checkov_finds_only_the_accepted_findings(tmp_path):
    failed, skipped = checkov(K8S, exclude="node-jobs")  # the overlay's patch alone is no manifest
    assert failed == set()
    assert skipped == {("kubernetes", c) for c in BASE_ACCEPTED} | {("dockerfile", "CKV_DOCKER_3")}
    with open(os.path.join(BASE, "daemonset.yaml")) as f:
        text = f.read()
    reasons = dict(SKIP.findall(text))
    assert set(reasons) == BASE_ACCEPTED and all(len(r) > 30 for r in reasons.values())
    # each skip is still a finding without it
    assert checkov(without_skips(tmp_path / "bare", text))[0] == {("kubernetes", c) for c in BASE_ACCEPTED}


def test_checkov_on_the_node_jobs_overlay(tmp_path):
    path = write_overlay(tmp_path / "overlay")
    failed, skipped = checkov(path.parent)
    assert failed == set() and skipped == {("kubernetes", c) for c in OVERLAY_ACCEPTED}
    with open(os.path.join(OVERLAY, "daemonset-patch.yaml")) as f:
        reasons = dict(SKIP.findall(f.read()))
    assert set(reasons) == OVERLAY_ACCEPTED - BASE_ACCEPTED and all(len(r) > 30 for r in reasons.values())
    bare = without_skips(tmp_path / "bare", path.read_text())
    assert checkov(bare)[0] == {("kubernetes", c) for c in OVERLAY_ACCEPTED}


def container(ds=None):
    ds = ds or by_kind()["DaemonSet"]
    spec = ds["spec"]["template"]["spec"]
    (memd,) = spec["containers"]
    return ds, spec, memd


def test_the_pieces_agree():
    kinds = by_kind()
    ds, spec, memd = container()
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    service, monitor, policy = kinds["Service"], kinds["ServiceMonitor"], kinds["NetworkPolicy"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert service["metadata"]["labels"][monitor["spec"]["jobLabel"]] == "memd"  # the alerts' job="memd"
    (port,) = memd["ports"]
    (service_port,) = service["spec"]["ports"]
    assert port["name"] == service_port["targetPort"] == service_port["name"] == monitor["spec"]["endpoints"][0]["port"]
    command = memd["command"]
    assert command[command.index("--metrics-address") + 1] == "0.0.0.0:%d" % port["containerPort"]
    assert command[command.index("--endpoint") + 1] == "ipc://%s/memd.sock" % SOCKET_DIR  # clients' default
    mounts = {m["name"]: m["mountPath"] for m in memd["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["run"]["hostPath"]["path"] == mounts["run"] == SOCKET_DIR
    assert command[command.index("--state-dir") + 1] == mounts["state"] and "hostPath" in volumes["state"]
    assert "hostPID" not in spec and "hostNetwork" not in spec and spec["automountServiceAccountToken"] is False
    context = memd["securityContext"]
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert context["readOnlyRootFilesystem"] and not context["allowPrivilegeEscalation"]
    assert memd["resources"]["limits"]["memory"] == "256Mi"  # as the unit's MemoryMax=


def test_node_jobs_overlay_adds_only_what_watching_host_jobs_takes():
    (ds,) = [d for d in rendered_overlay() if d["kind"] == "DaemonSet"]
    base, spec, memd = container()
    _, overlay_spec, overlay_memd = container(ds)
    assert {k: v for k, v in overlay_spec.items() if k not in spec} == {
        "hostPID": True, "hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet"}
    assert overlay_memd["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["SYS_PTRACE"]}
    assert dict(overlay_memd, securityContext=None) == dict(memd, securityContext=None)


def training_pod_example():
    with open(os.path.join(ROOT, "docs", "deploy.md")) as f:
        text = f.read()
    section = text.split("## Kubernetes", 1)[1]
    return yaml.safe_load(section.split("```yaml", 1)[1].split("```", 1)[0])


def test_docs_training_pod_reaches_the_socket(tmp_path):
    validate = tool("kubernetes-validate")
    pod = training_pod_example()
    path = tmp_path / "pod.yaml"
    path.write_text(yaml.safe_dump(pod))
    out = subprocess.run([validate, "--strict", "--quiet", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    _, spec, _ = container()
    volume = next(v for v in pod["spec"]["volumes"] if "hostPath" in v)
    assert volume["hostPath"]["path"] == SOCKET_DIR
    mount = next(m for c in pod["spec"]["containers"] for m in c["volumeMounts"] if m["name"] == volume["name"])
    assert mount["mountPath"] == SOCKET_DIR and mount["readOnly"] is True  # where the client looks first
    assert spec["securityContext"]["runAsGroup"] in pod["spec"]["securityContext"]["supplementalGroups"]


def test_container_command_and_probes_work_with_the_real_daemon(tmp_path):
    """The container's own command line and environment, with the node's paths moved under a
    temporary directory and the metrics on a free loopback port; then its probes."""
    _, _, memd = container()
    port = free_port()

    def here(word):
        return (word.replace(SOCKET_DIR, str(tmp_path / "run")).replace("/var/lib/memd", str(tmp_path / "state"))
                .replace("0.0.0.0:9463", "127.0.0.1:%d" % port))

    (tmp_path / "run").mkdir()
    assert memd["command"][0] == "memd"
    env = memd_env({e["name"]: e["value"] for e in memd["env"]})
    daemon = subprocess.Popen([sys.executable, "-m", "memd"] + [here(w) for w in memd["command"][1:]], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        probe = [here(w) for w in memd["livenessProbe"]["exec"]["command"]]
        assert probe[0] == "memd"
        for _ in range(200):  # 20 s at most to start
            if run_memd(probe[1:], timeout=30).returncode == 0:
                break
            assert daemon.poll() is None
            time.sleep(0.1)
        assert run_memd(probe[1:], timeout=30).returncode == 0
        ready = memd["readinessProbe"]["httpGet"]
        with urllib.request.urlopen("http://127.0.0.1:%d%s" % (port, ready["path"]), timeout=5) as response:
            assert response.status == 200 and b"memd_build_info" in response.read()
    finally:
        daemon.terminate()
        output = daemon.communicate(timeout=15)[0]
    assert daemon.returncode == 0, output
    assert all(line.startswith("{") for line in output.splitlines()), output  # MEMD_LOG_FORMAT=json
