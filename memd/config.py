"""One Config for the daemon: embedded defaults < TOML file < MEMD_* environment < flags.

Every error names the key and where its value came from, so ``memd serve`` can end with one
clear line instead of a traceback. docs/configuration.md lists every key.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import tempfile
import tomllib
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional
from urllib.parse import urlsplit

from memd.client.endpoint import SYSTEM_SOCKET, user_socket_path
from memd.units import GB, MiB


class ConfigError(ValueError):
    """A bad configuration value; the message is one line naming the key."""


@dataclass(frozen=True)
class PolicyConfig:
    """Thresholds and moves of the controller (docs/policy.md gives each one's source)."""
    # Kept free on top of the learned (upper-bound) peak, for what no report shows: kernel
    # memory, allocator rounding, others' growth between samples. The job's own spread is in
    # the curve, so this stays small: 1 % of the pool, at least 8 MiB. In a cgroup that bounds the
    # job, the 1 % only keeps room for the code pages its group maps (budget.group_margin).
    margin_ratio: float = 0.01
    margin_min_bytes: int = 8 * MiB
    # Kept for the OS out of the machine's RAM (never out of a job's own cgroup, where no OS
    # lives): seed 000's 8 GB, at most os_reserve_max_ratio of the RAM.
    os_reserve_bytes: int = 8 * GB
    os_reserve_max_ratio: float = 0.10
    elevated_some_avg10: float = 0.10  # PSI "some" ratio: tasks stalled on memory 10 % of the time
    high_some_avg10: float = 0.25
    critical_full_avg10: float = 0.10  # PSI "full": every task stalled 10 % of the time
    critical_available_ratio: float = 0.02  # or less than 2 % of the pool still available
    calm_seconds: float = 10.0  # a pressure level is left only after this long below its threshold
    oom_cut: float = 0.25  # cut the batch by this share after an OOM (seed 000)
    stable_steps: int = 10  # clean steps before growing back toward an OOM ceiling
    max_growth: float = 2.0  # one move at most multiplies the batch by this
    # How far one step's peak may rise above the job's typical peak at its batch, assumed until
    # the job's reports show its own spread. Host RAM: glibc's peaks of one batch are bimodal,
    # the upper mode up to 7 % up and seen in streaks (measured, docs/results.md); a GPU's
    # caching allocator is steadier (not yet measured on hardware: the earlier 2 % assumption).
    peak_spread_host: float = 0.07
    peak_spread_gpu: float = 0.02
    # Growth smaller than this share of the batch is not worth a change: each change costs the
    # job a DataLoader rebuild and leaves the old batch's memory in its allocator.
    min_gain: float = 0.03
    # A dataloader worker that grows is counted at what it reaches this far ahead, at its rate:
    # a worker copying a Python-object dataset as it reads it must be cut before the pool is gone.
    worker_horizon_seconds: float = 30.0
    plan_fresh_seconds: float = 1.0  # how long a client may serve a plan from its cache
    # How long memory that grew outside a pool's sessions (another process of the job's group, of
    # the host) keeps its rate of growth held back from their budgets (planner.growth_ahead).
    others_horizon_seconds: float = 10.0
    # Where an overshoot kills, a job's first spike_steps reports leave spike_reserve of its step's
    # own memory (the peak above the curve's fixed part) unplanned: a rarer step that peaks higher
    # (an evaluation, a long batch, one step in twenty twice the others) shows meanwhile, and its
    # report then bounds the curve (invariants.py; tests/test_invariants.py pins both).
    spike_steps: int = 24
    spike_reserve: float = 0.5


@dataclass(frozen=True)
class Config:
    endpoint: Optional[str] = None  # None: the default for this user (see memd.client.endpoint.default_endpoint)
    metrics_address: str = "127.0.0.1:9463"  # HOST:PORT, or "off"
    interval: float = 0.2  # seconds between samples of the cheap signals
    job_interval: float = 2.0  # seconds between reads of each job's process tree
    flush_interval: float = 2.0  # seconds between writes of what live sessions learned (state.flush_soon)
    state_dir: Optional[str] = None
    max_sessions: int = 256
    max_connections: int = 512  # beyond it the newest connection is shut down (memd/guard.py)
    session_ttl: float = 600.0  # seconds of silence after which a session is dropped
    log_level: str = "info"
    log_format: str = "auto"  # auto (JSON unless on a terminal), json or console
    curve_secret_key_file: Optional[str] = None  # the daemon's CURVE key: required for non-loopback tcp
    curve_client_keys_dir: Optional[str] = None  # the clients' public .key files: required with CURVE
    policy: PolicyConfig = field(default_factory=PolicyConfig)

    def resolved_endpoint(self) -> str:
        if self.endpoint:
            return self.endpoint
        if os.environ.get("MEMD_ENDPOINT"):
            return os.environ["MEMD_ENDPOINT"]
        if os.geteuid() == 0:
            return "ipc://" + SYSTEM_SOCKET
        return "ipc://" + user_socket_path()

    def resolved_state_dir(self) -> str:
        if self.state_dir:
            return self.state_dir
        if os.environ.get("STATE_DIRECTORY"):  # set by systemd's StateDirectory=
            return os.environ["STATE_DIRECTORY"].split(":")[0]
        if os.geteuid() == 0:
            return "/var/lib/memd"
        base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
        return os.path.join(base, "memd")


def load(path: Optional[str] = None, environ: Optional[Mapping[str, str]] = None,
         flags: Optional[Dict[str, Any]] = None, starting: bool = False) -> Config:
    """Build the Config; raises ConfigError naming the offending key. ``starting``: the daemon
    is about to start with it, so the state directory must also be one it can write (a reload
    keeps the directory it started with)."""
    env = os.environ if environ is None else environ
    values: Dict[str, Any] = {}
    policy: Dict[str, Any] = {}
    origins: Dict[str, str] = {}  # where each key's value came from: "policy.calm_seconds" -> "MEMD_..."
    if path:
        _merge_file(path, values, policy, origins)
    _merge_env(env, values, policy, origins)
    for name, value in (flags or {}).items():
        if value is not None:
            origins[name] = "--" + name.replace("_", "-")
            values[name] = _coerce(Config, name, value, origins[name])
    config = Config(**values, policy=PolicyConfig(**policy))
    validate(config, origins)
    if starting:
        default = "$STATE_DIRECTORY" if env.get("STATE_DIRECTORY") else "the default"
        check_state_dir(config.resolved_state_dir(), origins.get("state_dir", default))
    return config


def check_state_dir(directory: str, origin: str) -> None:
    """Refuse a state directory the daemon cannot write, at start: found at the first flush, a
    daemon that had accepted it would lose every learned curve, with only a log line to say so."""
    try:
        os.makedirs(directory, mode=0o750, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".memd-probe.", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError("config key 'state_dir' %s is not a directory memd can write: %s (%s)" % (
            directory, exc.strerror or exc, origin)) from None


def _merge_file(path: str, values: Dict[str, Any], policy: Dict[str, Any], origins: Dict[str, str]) -> None:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError("config file %s does not exist" % path) from None
    except OSError as exc:
        raise ConfigError("config file %s unreadable: %s" % (path, exc.strerror)) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config file %s is not valid TOML: %s" % (path, exc)) from None
    except UnicodeDecodeError as exc:  # TOML is UTF-8: tomllib lets this one through
        raise ConfigError("config file %s is not UTF-8 text (byte %d)" % (path, exc.start)) from None
    for key, value in data.items():
        if key == "policy":
            if not isinstance(value, dict):
                raise ConfigError("config key 'policy' in %s must be a table" % path)
            for pkey, pvalue in value.items():
                origins["policy." + pkey] = "policy.%s in %s" % (pkey, path)
                policy[pkey] = _coerce(PolicyConfig, pkey, pvalue, origins["policy." + pkey])
        else:
            origins[key] = "%s in %s" % (key, path)
            values[key] = _coerce(Config, key, value, origins[key])


def _merge_env(env: Mapping[str, str], values: Dict[str, Any], policy: Dict[str, Any],
               origins: Dict[str, str]) -> None:
    for f in dataclasses.fields(Config):
        if f.name != "policy" and env.get("MEMD_" + f.name.upper()):
            origins[f.name] = "MEMD_" + f.name.upper()
            values[f.name] = _coerce(Config, f.name, env[origins[f.name]], origins[f.name])
    for f in dataclasses.fields(PolicyConfig):
        name = "MEMD_POLICY_" + f.name.upper()
        if env.get(name):
            origins["policy." + f.name] = name
            policy[f.name] = _coerce(PolicyConfig, f.name, env[name], name)


def _coerce(cls: type, key: str, value: Any, origin: str) -> Any:
    types = {f.name: f.type for f in dataclasses.fields(cls)}
    if key not in types or key == "policy":
        known = ", ".join(sorted(n for n in types if n != "policy"))
        raise ConfigError("unknown config key '%s' (%s); known keys: %s" % (key, origin, known))
    kind = str(types[key])
    try:
        if kind == "float":
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if kind == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if value is None or isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return None if value is None else str(value)
        raise ValueError
    except (TypeError, ValueError):
        want = {"float": "a number", "int": "an integer"}.get(kind, "a string")
        raise ConfigError("config key '%s' must be %s, got %r (%s)" % (key, want, value, origin)) from None


def validate(config: Config, origins: Optional[Mapping[str, str]] = None) -> None:
    """Refuse a value no daemon could run with: one line naming the key and, where ``origins``
    knows it, where the value came from (the file, the environment variable, the flag)."""
    where = origins or {}

    def bad(key: str, why: str) -> ConfigError:
        return ConfigError("config key '%s' %s%s" % (key, why, " (%s)" % where[key] if key in where else ""))

    if not config.interval > 0 or config.interval > 60:
        raise bad("interval", "must be in (0, 60] seconds, got %r" % config.interval)
    if not config.flush_interval > 0:
        raise bad("flush_interval", "must be a positive number of seconds")
    if not config.job_interval >= config.interval:
        raise bad("job_interval", "must be at least 'interval' (%s s)" % config.interval)
    if config.max_sessions < 1:
        raise bad("max_sessions", "must be at least 1")
    if config.max_connections < 1:
        raise bad("max_connections", "must be at least 1")
    if not config.session_ttl > 0:
        raise bad("session_ttl", "must be positive")
    if config.log_level.lower() not in ("debug", "info", "warning", "error"):
        raise bad("log_level", "must be debug, info, warning or error")
    if config.log_format not in ("auto", "json", "console"):
        raise bad("log_format", "must be auto, json or console")
    check_curve(config)
    if config.endpoint:
        check_endpoint(config.endpoint, secure=bool(config.curve_secret_key_file))
    if config.metrics_address != "off":
        parse_address(config.metrics_address)
    p = config.policy
    for name in ("margin_ratio", "os_reserve_max_ratio", "elevated_some_avg10", "high_some_avg10",
                 "critical_full_avg10", "critical_available_ratio", "oom_cut", "min_gain", "peak_spread_host",
                 "peak_spread_gpu"):
        if not 0 <= getattr(p, name) < 1:
            raise bad("policy." + name, "must be a ratio in [0, 1), got %r" % getattr(p, name))
    if not p.elevated_some_avg10 <= p.high_some_avg10:
        raise bad("policy.high_some_avg10", "must be >= 'policy.elevated_some_avg10'")
    for name in ("margin_min_bytes", "os_reserve_bytes"):  # bytes: beyond 1 PiB is no machine's
        if not 0 <= getattr(p, name) <= 2 ** 50:
            raise bad("policy." + name, "must be a number of bytes in [0, 2**50], got %r" % getattr(p, name))
    if not 0 <= p.calm_seconds < math.inf:
        raise bad("policy.calm_seconds", "must be a finite number of seconds >= 0, got %r" % p.calm_seconds)
    if not p.worker_horizon_seconds >= 0:
        raise bad("policy.worker_horizon_seconds", "must be a number of seconds >= 0")
    if p.stable_steps < 1:
        raise bad("policy.stable_steps", "must be at least 1, got %r" % p.stable_steps)
    if not p.max_growth > 1:
        raise bad("policy.max_growth", "must be > 1, got %r" % p.max_growth)
    if not p.plan_fresh_seconds > 0:
        raise bad("policy.plan_fresh_seconds", "must be a positive number of seconds, got %r" % p.plan_fresh_seconds)


def check_curve(config: Config) -> None:
    """CURVE comes with its allow-list or not at all: a CURVE socket without one encrypts but
    admits any client key (issue 12: a random key got a session)."""
    if config.curve_secret_key_file and not config.curve_client_keys_dir:
        raise ConfigError("config key 'curve_client_keys_dir' is required with 'curve_secret_key_file': CURVE "
                          "without an allow-list of client keys admits anyone (docs/deploy.md)")
    if config.curve_client_keys_dir and not config.curve_secret_key_file:
        raise ConfigError("config key 'curve_client_keys_dir' needs 'curve_secret_key_file' (the daemon's own "
                          "CURVE key): without it no client is asked for a key")


def check_endpoint(endpoint: str, secure: bool = False) -> None:
    """Accept ipc:// paths and tcp:// addresses (loopback only unless CURVE is configured)."""
    if endpoint.startswith("ipc://"):
        if len(endpoint) <= len("ipc://"):
            raise ConfigError("endpoint %r has no socket path" % endpoint)
        return
    if not endpoint.startswith("tcp://"):
        raise ConfigError("endpoint %r must start with ipc:// or tcp://" % endpoint)
    try:
        parts = urlsplit(endpoint)
        host, port = parts.hostname, parts.port
    except ValueError:
        raise ConfigError("endpoint %r is not a valid tcp://HOST:PORT" % endpoint) from None
    if not host or port is None:
        raise ConfigError("endpoint %r is not a valid tcp://HOST:PORT" % endpoint)
    if not secure and not _is_loopback(host):
        raise ConfigError("endpoint %r is not loopback: set curve_secret_key_file to expose the "
                          "control socket beyond this host" % endpoint)


def parse_address(address: str) -> tuple:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError("metrics address %r must be HOST:PORT or 'off' (--metrics-address)" % address)
    return host.strip("[]") or "0.0.0.0", int(port)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
