"""The fleet's plan: configuration, checks, and every command line. Pure (no process is started here).

One host, N replicas of ``python -m qwen_vllm_ext.serve`` (unchanged, each on its own loopback port, its GPUs
or CPU cores and its own data directory), one Redis shared by all of them (keys, limiter, ledger; a local
``redis-server`` with persistence when no URL is given) and ``vllm-router`` in front. Ports: the router on
``--port P``, replicas on ``P+1 .. P+N``, the router's Prometheus exporter on ``P+N+1``, the local Redis on
``P+N+2``.

Router flags (read off vllm-router 0.1.17 with fake workers, see docs/fleet.md): by default it re-sends a
request answered 408, 429 or 5xx to another worker (up to 5 attempts) and its circuit breaker counts 5xx
answers as worker failures. One client request must stay one request (a 429 is an answer, not a fault) and a
fail-closed 503 during a Redis outage must not take healthy replicas out of rotation, so every router of ours
runs with :data:`ROUTER_FLAGS`; a dead replica is found by the active health check on ``/health`` instead.
"""
from __future__ import annotations

import dataclasses
import os
import shlex
from collections.abc import Sequence

from ..launcher.hardware import split_cores

DEFAULT_POLICY = "consistent_hash"
"""Conversation affinity: vllm-router 0.1.17's ``consistent_hash`` hashes the ``x-session-id`` header (it
outranks ``x-request-id``; the body's ``user`` and ``x-conversation-id`` are not used)."""
POLICIES = ("consistent_hash", "cache_aware", "round_robin", "power_of_two", "random", "sticky_least_loaded")
HEALTH_PATH = "/health"  # vLLM's own health route: 200 while the engine is alive
ROUTER_READY_PATH = "/readiness"  # vllm-router: 503 until a worker is healthy (its /health is 200 with no workers)

ROUTER_FLAGS: tuple[str, ...] = (
    "--disable-retries",          # a 429 (and any 5xx) would otherwise be re-sent to another replica, up to 5 times
    "--disable-circuit-breaker",  # it counts 5xx answers (limiter store down: 503) and would drop healthy replicas
    "--health-check-endpoint", HEALTH_PATH,
    "--health-check-interval-secs", "1",
    "--health-failure-threshold", "2",
    "--health-success-threshold", "1",
)
"""Flags every router in front of our replicas runs with (the fleet command and deploy/kubernetes)."""

# Router flags the fleet sets itself, and flags that would bring back retries or the circuit breaker.
_ROUTER_OWNED = ("--host", "--port", "--worker-urls", "--policy", "--prometheus-port", "--prometheus-host",
                 "--health-check-endpoint")
_ROUTER_REFUSED = {
    "--retry-max-retries": "the router would re-send a 429 (and 5xx) to another replica: one client request "
                           "would become several and a rate limit would be answered more than once",
    "--retry-initial-backoff-ms": "retries stay off in a fleet (see --retry-max-retries)",
    "--cb-failure-threshold": "the circuit breaker counts 5xx answers: a Redis outage (fail-closed 503s) would take "
                              "every healthy replica out of rotation for --cb-timeout-duration-secs after it ends",
    "--cb-timeout-duration-secs": "the circuit breaker stays off in a fleet (see --cb-failure-threshold)",
}
# Replica flags the fleet sets itself (each replica gets its own port and data directory, all share Redis).
_SERVE_OWNED = ("--host", "--port", "--qwen-data-dir", "--qwen-require-shared-state")
_SERVE_STATE = ("--qwen-ledger-backend", "--qwen-limiter-backend")


class FleetError(RuntimeError):
    """The fleet refuses this configuration; the message says what to do."""


@dataclasses.dataclass(frozen=True)
class FleetConfig:
    replicas: int = 2
    port: int = 8000
    host: str = "127.0.0.1"  # the router's bind address (replicas always bind loopback: only the router calls them)
    redis_url: str = ""  # empty: a local redis-server, persistent in <data_dir>/redis
    policy: str = DEFAULT_POLICY
    data_dir: str = ""
    serve_args: tuple[str, ...] = ()  # given to every replica (vLLM flags, --profile, --model, --qwen-*)
    router_args: tuple[str, ...] = ()  # extra vllm-router flags


@dataclasses.dataclass(frozen=True)
class Proc:
    """One process of the fleet."""

    name: str  # "redis", "replica-0", ..., "router"
    argv: tuple[str, ...]
    env: dict  # additions to the fleet command's environment
    port: int
    log: str
    placement: str = ""  # "GPUs 0,1" / "cores 0-3" (replicas)
    ready_path: str = HEALTH_PATH  # GET answers 200 once the process serves

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command_line(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return (env + " " if env else "") + shlex.join(self.argv)


@dataclasses.dataclass(frozen=True)
class FleetPlan:
    config: FleetConfig
    redis: Proc | None  # None: an external Redis (config.redis_url)
    replicas: tuple[Proc, ...]
    router: Proc
    redis_url: str

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "::", "") else self.config.host
        return f"http://{host}:{self.config.port}"

    @property
    def processes(self) -> tuple[Proc, ...]:
        return ((self.redis,) if self.redis else ()) + self.replicas + (self.router,)

    @property
    def ports(self) -> list[tuple[str, int]]:
        out = [(p.name, p.port) for p in self.processes]
        out.insert(-1, ("router metrics", metrics_port(self.config)))
        return out


def metrics_port(config: FleetConfig) -> int:
    return config.port + config.replicas + 1


def _flag_value(args: Sequence[str], *names: str) -> str | None:
    """The value of the last ``--flag VALUE`` / ``--flag=VALUE`` among ``names`` in ``args``."""
    value = None
    for i, a in enumerate(args):
        for n in names:
            if a == n and i + 1 < len(args):
                value = args[i + 1]
            elif a.startswith(n + "="):
                value = a[len(n) + 1:]
    return value


def _has_flag(args: Sequence[str], name: str) -> bool:
    return any(a == name or a.startswith(name + "=") for a in args)


def tensor_parallel_size(serve_args: Sequence[str]) -> int:
    value = _flag_value(serve_args, "--tensor-parallel-size", "-tp")
    try:
        tp = int(value) if value is not None else 1
    except ValueError:
        raise FleetError(f"--tensor-parallel-size {value!r} is not a number") from None
    if tp < 1:
        raise FleetError(f"--tensor-parallel-size must be at least 1 (got {tp})")
    return tp


def check(config: FleetConfig) -> None:
    """Refuse configurations that would break the fleet's guarantees (FleetError says what to do)."""
    if config.replicas < 1:
        raise FleetError(f"--replicas must be at least 1 (got {config.replicas})")
    if not 1 <= config.port <= 65535 - config.replicas - 2:
        raise FleetError(f"--port {config.port} leaves no room for {config.replicas} replica ports after it")
    if config.policy not in POLICIES:
        raise FleetError(f"--policy {config.policy!r} is not one of {', '.join(POLICIES)}")
    if config.redis_url and not config.redis_url.startswith(("redis://", "rediss://", "unix://")):
        raise FleetError(f"--redis-url {config.redis_url!r} must start with redis://, rediss:// or unix://")
    for flag in _ROUTER_OWNED:
        if _has_flag(config.router_args, flag):
            raise FleetError(f"router flag {flag} is set by the fleet; use the fleet's own options "
                             "(--host, --port, --replicas, --policy)")
    for flag, why in _ROUTER_REFUSED.items():
        if _has_flag(config.router_args, flag):
            raise FleetError(f"router flag {flag} refused: {why}")
    for flag in _SERVE_OWNED:
        if _has_flag(config.serve_args, flag):
            raise FleetError(f"replica flag {flag} is set by the fleet (each replica gets its own port and data "
                             "directory under --data-dir, and must use the shared Redis)")
    for flag in _SERVE_STATE:
        value = _flag_value(config.serve_args, flag)
        if value is not None and value != "redis":
            raise FleetError(f"{flag} {value} refused: every replica must keep keys, limits and the ledger in the "
                             "fleet's one Redis (per-replica state would split every limit between replicas)")
    tensor_parallel_size(config.serve_args)


def _id_list(ids: Sequence[int]) -> str:
    return ",".join(str(i) for i in ids)


def placements(config: FleetConfig, gpus: Sequence[int], cpus: Sequence[int], environ: dict) -> list[tuple[dict, str]]:
    """(environment, description) per replica: GPUs split by tensor-parallel size, else CPU cores split."""
    n = config.replicas
    if gpus:
        tp = tensor_parallel_size(config.serve_args)
        if n * tp > len(gpus):
            raise FleetError(f"{n} replicas x tensor-parallel size {tp} need {n * tp} GPUs; this host shows "
                             f"{len(gpus)}: lower --replicas or --tensor-parallel-size")
        return [({"CUDA_VISIBLE_DEVICES": _id_list(gpus[i * tp:(i + 1) * tp])},
                 "GPUs " + _id_list(gpus[i * tp:(i + 1) * tp])) for i in range(n)]
    if "VLLM_CPU_OMP_THREADS_BIND" in environ:  # the user binds threads (e.g. "nobind"): every replica inherits it
        return [({}, "cores per VLLM_CPU_OMP_THREADS_BIND=" + environ["VLLM_CPU_OMP_THREADS_BIND"])] * n
    if not cpus:
        raise FleetError("no CPU cores are available to this process")
    if len(cpus) < n:
        raise FleetError(f"{n} CPU replicas need at least {n} cores (this process may use {len(cpus)}): each "
                         "replica's engine binds its own cores; lower --replicas (or set VLLM_CPU_OMP_THREADS_BIND "
                         "yourself, e.g. nobind, to let them share cores)")
    return [({"VLLM_CPU_OMP_THREADS_BIND": _id_list(part)}, "cores " + _id_list(part))
            for part in split_cores(cpus, n)]


def build(config: FleetConfig, *, python: str, router_bin: str, redis_bin: str, gpus: Sequence[int] = (),
          cpus: Sequence[int] = (), environ: dict | None = None) -> FleetPlan:
    """Every process of the fleet with its command line (nothing is started)."""
    check(config)
    environ = {} if environ is None else environ
    data_dir = config.data_dir
    logs = os.path.join(data_dir, "logs")
    redis = None
    redis_url = config.redis_url
    if not redis_url:
        rport = config.port + config.replicas + 2
        redis_url = f"redis://127.0.0.1:{rport}/0"
        redis = Proc("redis", (redis_bin, "--bind", "127.0.0.1", "--port", str(rport),
                               "--dir", os.path.join(data_dir, "redis"), "--appendonly", "yes",
                               "--appendfsync", "everysec", "--save", "", "--daemonize", "no",
                               "--protected-mode", "yes"),
                     {}, rport, os.path.join(logs, "redis.log"))
    replicas = []
    for i, (env, where) in enumerate(placements(config, gpus, cpus, environ)):
        port = config.port + 1 + i
        argv = (python, "-m", "qwen_vllm_ext.serve", "--host", "127.0.0.1", "--port", str(port),
                "--qwen-data-dir", os.path.join(data_dir, f"replica-{i}"),
                "--qwen-ledger-backend", "redis", "--qwen-ledger-redis-url", redis_url,
                "--qwen-limiter-backend", "redis", "--qwen-require-shared-state", "true", *config.serve_args)
        replicas.append(Proc(f"replica-{i}", argv, env, port, os.path.join(logs, f"replica-{i}.log"), where))
    router = Proc("router", (router_bin, "--host", config.host, "--port", str(config.port),
                             "--worker-urls", *[r.url for r in replicas], "--policy", config.policy,
                             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port(config)),
                             *ROUTER_FLAGS, *config.router_args),
                  {}, config.port, os.path.join(logs, "router.log"), ready_path=ROUTER_READY_PATH)
    return FleetPlan(config, redis, tuple(replicas), router, redis_url)
