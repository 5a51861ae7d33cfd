"""Ownership by CURVE key, over real TCP with real keys against the real daemon: a remote job
(a host the daemon cannot watch) learns and recalls its curves under the key it was admitted
with; another key neither reads, overwrites, evicts nor forgets them; a key's flood of job names
evicts only its own; and every key is its own user in the sharing of session slots."""
import json
import shutil

import pytest

from memd.client import Refused, Session, call, curve, protocol
from realdaemon import Daemon, free_port, run_memd, wait_for

GB = 10 ** 9
REMOTE = "trainer.elsewhere.example"  # a host the daemon cannot watch: planned from its reports
WHO = ("alice", "bob", "carol")


@pytest.fixture
def keys(tmp_path):
    """The daemon's pair, and alice, bob and carol, each listed in the allow-list."""
    made = {name: curve.write_keypair(str(tmp_path / "keys"), name) for name in ("server",) + WHO}
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    for name in WHO:
        shutil.copy(made[name][0], allowed)
    found = {"server_public": made["server"][0], "server_secret": made["server"][1], "allowed": str(allowed)}
    for name in WHO:
        found[name] = made[name][1]
        found[name + "_public"] = curve.read_public_key(made[name][0], "test").decode()
    return found


def start(tmp_path, keys, **env):
    return Daemon(tmp_path, endpoint="tcp://0.0.0.0:%d" % free_port(),
                  env=dict({"MEMD_CURVE_SECRET_KEY_FILE": keys["server_secret"],
                            "MEMD_CURVE_CLIENT_KEYS_DIR": keys["allowed"]}, **env),
                  keys={"server_key": keys["server_public"], "client_key_file": keys["alice"]}).start()


@pytest.fixture
def daemon(tmp_path, keys):
    d = start(tmp_path, keys)
    yield d
    d.stop()


def as_client(keys, who):
    return {"server_key": keys["server_public"], "client_key_file": keys[who]}


def ask(daemon, keys, who, op, **fields):
    return call(op, endpoint=daemon.endpoint, timeout=2.0, **as_client(keys, who), **fields)


def remote_hello(daemon, keys, who, job):
    """A hello from a job on another machine: (token, its first plan's reason)."""
    reply = ask(daemon, keys, who, "hello", job=job, pid=4242, host=REMOTE, min_batch=1, default_batch=4)
    return reply["token"], reply["plan"]["reason"]


def remote_run(daemon, keys, who, job, peak_at_8):
    """One run of a remote job: a warm-up step at 4, a step at 8, then bye. The reason of its first plan."""
    token, reason = remote_hello(daemon, keys, who, job)
    ask(daemon, keys, who, "report", token=token, batch_size=4, peak_bytes=GB)
    ask(daemon, keys, who, "report", token=token, batch_size=8, peak_bytes=peak_at_8)
    ask(daemon, keys, who, "bye", token=token)
    return reason


def owned(daemon, job):
    """owner -> points of the curves of ``job``, every page."""
    found, after = {}, None
    while True:
        reply = daemon.call("curves", **({} if after is None else {"after": after}))
        found.update({c["owner"]: c["points"] for c in reply["curves"] if c["job"] == job})
        after = reply["next"]
        if after is None:
            return found


def test_a_remote_keys_curve_is_its_own_another_key_neither_reads_overwrites_nor_forgets_it(daemon, keys):
    alice, bob = "key:" + keys["alice_public"], "key:" + keys["bob_public"]
    assert "no reports yet" in remote_run(daemon, keys, "alice", "llama-ft", GB + 8 * 10 ** 8)
    assert owned(daemon, "llama-ft") == {alice: [[8, GB + 8 * 10 ** 8]]}  # kept: before, a remote job never was
    # bob, a job of the same name: starts from nothing, learns beside alice's, replaces nothing
    assert "no reports yet" in remote_run(daemon, keys, "bob", "llama-ft", 3 * GB)
    assert owned(daemon, "llama-ft") == {alice: [[8, GB + 8 * 10 ** 8]], bob: [[8, 3 * GB]]}
    shown = run_memd(["curves", "--endpoint", daemon.endpoint, "--server-key", keys["server_public"],
                      "--client-key", keys["bob"]])
    assert shown.returncode == 0 and "the client whose CURVE public key is %s" % keys["bob_public"] in shown.stdout
    # bob's forget drops bob's curve only; alice's next run starts from hers
    assert ask(daemon, keys, "bob", "forget", job="llama-ft")["forgotten"] == 1
    assert owned(daemon, "llama-ft") == {alice: [[8, GB + 8 * 10 ** 8]]}
    token, reason = remote_hello(daemon, keys, "alice", "llama-ft")
    assert "from earlier runs of this job" in reason, reason
    assert ask(daemon, keys, "bob", "forget", job="llama-ft")["sessions"] == 0  # alice's live session is not bob's
    ask(daemon, keys, "alice", "bye", token=token)


def test_old_state_files_are_read_and_their_curves_are_not_a_keys(tmp_path, keys):
    """Curves kept before keys (no owner) and a local user's (uid:0) stay readable and shown, but
    a remote key's job of the same name starts from nothing and overwrites neither."""
    daemon = start(tmp_path, keys)
    try:
        remote_run(daemon, keys, "alice", "llama-ft", 2 * GB)
        [entry] = daemon.call("curves")["curves"]
    finally:
        daemon.stop()
    pool = entry["pool"][:-len("@key:") - 40]  # the pool alone, as an earlier memd keyed it
    state = tmp_path / "state" / "curves.json"
    data = json.loads(state.read_text())
    for owner in ("", "@uid:0"):
        data["jobs"]["llama-ft|%s%s" % (pool, owner)] = {"points": [[8, 5 * GB]], "ceiling": None, "updated": 1.0}
    state.write_text(json.dumps(data))
    daemon = start(tmp_path, keys)
    try:
        assert owned(daemon, "llama-ft") == {None: [[8, 5 * GB]], "uid:0": [[8, 5 * GB]],
                                             "key:" + keys["alice_public"]: [[8, 2 * GB]]}
        assert "no reports yet" in remote_run(daemon, keys, "carol", "llama-ft", 3 * GB)  # neither is carol's
        assert owned(daemon, "llama-ft")[None] == [[8, 5 * GB]]
        assert owned(daemon, "llama-ft")["uid:0"] == [[8, 5 * GB]]
    finally:
        daemon.stop()


def test_a_flood_of_job_names_from_one_key_evicts_only_its_own(daemon, keys):
    alice, carol = "key:" + keys["alice_public"], "key:" + keys["carol_public"]
    remote_run(daemon, keys, "alice", "llama-ft", 2 * GB)
    for i in range(40):  # past the 32 curves a key keeps
        token, _ = remote_hello(daemon, keys, "carol", "junk-%02d" % i)
        ask(daemon, keys, "carol", "oom", token=token, batch_size=8)
        ask(daemon, keys, "carol", "bye", token=token)
    kept, after = [], None
    while True:
        reply = daemon.call("curves", limit=10, **({} if after is None else {"after": after}))
        assert len(reply["curves"]) <= 10
        kept += [(c["job"], c["owner"]) for c in reply["curves"]]
        after = reply["next"]
        if after is None:
            break
    assert ("llama-ft", alice) in kept
    assert sorted(job for job, owner in kept if owner == carol) == ["junk-%02d" % i for i in range(8, 40)]


def test_each_key_is_its_own_user_in_the_sharing_of_slots(tmp_path, keys):
    """Eight slots, all alice's: bob's jobs take the newest of hers until they hold half, then
    neither takes more. Over TCP all peers were one user: bob got too_many_sessions. A remote
    job's hello never ends a local session."""
    daemon = start(tmp_path, keys, MEMD_MAX_SESSIONS="8")
    opened = []

    def session(who, job):
        s = Session(job, endpoint=daemon.endpoint, timeout=1.0, default_batch=4, **as_client(keys, who))
        opened.append(s)
        return s.plan()

    def jobs():
        return sorted(s["job"] for s in daemon.call("status")["sessions"])

    try:
        assert all(session("alice", "a%d" % i).source == "daemon" for i in range(8))
        with pytest.raises(Refused) as refused:
            remote_hello(daemon, keys, "carol", "remote")  # no unwatched session to give way: none local does
        assert refused.value.code == protocol.TOO_MANY_SESSIONS
        assert all(session("bob", "b%d" % i).source == "daemon" for i in range(4))
        assert jobs() == ["a0", "a1", "a2", "a3", "b0", "b1", "b2", "b3"]
        assert session("bob", "b4").source == "fallback"  # four each: bob takes no more
        assert session("alice", "a8").source == "fallback"  # nor alice back
        assert jobs() == ["a0", "a1", "a2", "a3", "b0", "b1", "b2", "b3"]
        assert wait_for(lambda: daemon.log().count('"reason": "evicted"') == 4)
    finally:
        for s in opened:
            s.close()
        daemon.stop()

