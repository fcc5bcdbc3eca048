"""The fleet's plan (pure): command lines, placement of replicas, and the configurations it refuses."""
from __future__ import annotations

import socket

import pytest

from qwen_vllm_ext.fleet import processes
from qwen_vllm_ext.fleet.__main__ import config_from_args, main
from qwen_vllm_ext.fleet.plan import (DEFAULT_POLICY, ROUTER_FLAGS, FleetConfig, FleetError, build, check,
                                      tensor_parallel_size)

BINS = dict(python="/py", router_bin="/bin/vllm-router", redis_bin="/bin/redis-server")


def plan_of(cpus=(0, 1), gpus=(), environ=None, **kw):
    return build(FleetConfig(data_dir="/d", **kw), cpus=cpus, gpus=gpus, environ=environ, **BINS)


def _value(argv, flag):
    return argv[argv.index(flag) + 1]


def test_two_cpu_replicas_share_one_redis_behind_the_router():
    plan = plan_of(replicas=2, port=9000)
    assert [p.name for p in plan.processes] == ["redis", "replica-0", "replica-1", "router"]
    assert plan.redis_url == "redis://127.0.0.1:9004/0" and _value(plan.redis.argv, "--appendonly") == "yes"
    assert [r.port for r in plan.replicas] == [9001, 9002]
    for i, r in enumerate(plan.replicas):
        assert r.argv[:3] == ("/py", "-m", "qwen_vllm_ext.serve")
        assert _value(r.argv, "--host") == "127.0.0.1"
        assert _value(r.argv, "--qwen-ledger-redis-url") == plan.redis_url
        assert _value(r.argv, "--qwen-ledger-backend") == _value(r.argv, "--qwen-limiter-backend") == "redis"
        assert _value(r.argv, "--qwen-require-shared-state") == "true"
        assert _value(r.argv, "--qwen-data-dir") == f"/d/replica-{i}"
        assert r.env == {"VLLM_CPU_OMP_THREADS_BIND": str(i)} and r.placement == f"cores {i}"
    router = plan.router.argv
    assert _value(router, "--policy") == DEFAULT_POLICY and _value(router, "--port") == "9000"
    urls = router[router.index("--worker-urls") + 1:router.index("--policy")]
    assert list(urls) == ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    assert _value(router, "--prometheus-port") == "9003"
    start = router.index(ROUTER_FLAGS[0])
    assert router[start:start + len(ROUTER_FLAGS)] == ROUTER_FLAGS
    assert plan.router.ready_path == "/readiness" and plan.replicas[0].ready_path == "/health"
    assert [port for _, port in plan.ports] == [9004, 9001, 9002, 9003, 9000]


def test_external_redis_and_user_thread_binding_are_kept():
    plan = plan_of(replicas=2, redis_url="redis://10.0.0.5:6379/1", environ={"VLLM_CPU_OMP_THREADS_BIND": "0-1"})
    assert plan.redis is None and plan.redis_url == "redis://10.0.0.5:6379/1"
    assert all(r.env == {} for r in plan.replicas)
    shared = plan_of(replicas=3, cpus=(0, 1), environ={"VLLM_CPU_OMP_THREADS_BIND": "nobind"})
    assert [r.placement for r in shared.replicas] == ["cores per VLLM_CPU_OMP_THREADS_BIND=nobind"] * 3


def test_gpus_are_split_by_tensor_parallel_size():
    plan = plan_of(replicas=2, gpus=[0, 1, 2, 3], serve_args=("--tensor-parallel-size", "2"))
    assert [r.env["CUDA_VISIBLE_DEVICES"] for r in plan.replicas] == ["0,1", "2,3"]
    assert tensor_parallel_size(["-tp=4"]) == 4 and tensor_parallel_size([]) == 1
    with pytest.raises(FleetError, match=r"3 replicas x tensor-parallel size 2 need 6 GPUs; this host shows 4"):
        plan_of(replicas=3, gpus=[0, 1, 2, 3], serve_args=("-tp", "2"))


def test_cpu_cores_are_split_and_too_few_cores_are_refused():
    plan = plan_of(replicas=2, cpus=range(8))
    assert [r.env["VLLM_CPU_OMP_THREADS_BIND"] for r in plan.replicas] == ["0,1,2,3", "4,5,6,7"]
    with pytest.raises(FleetError, match="3 CPU replicas need at least 3 cores"):
        plan_of(replicas=3, cpus=(0, 1))


@pytest.mark.parametrize("kw,message", [
    (dict(replicas=0), "--replicas must be at least 1"),
    (dict(policy="nearest"), "--policy 'nearest' is not one of"),
    (dict(redis_url="http://x"), "must start with redis://"),
    (dict(router_args=("--retry-max-retries", "3")), "the router would re-send a 429"),
    (dict(router_args=("--cb-failure-threshold=5",)), "circuit breaker counts 5xx"),
    (dict(router_args=("--policy", "random")), "set by the fleet"),
    (dict(serve_args=("--port", "1")), "set by the fleet"),
    (dict(serve_args=("--qwen-limiter-backend", "sqlite")), "refused: every replica must keep keys, limits"),
    (dict(serve_args=("--qwen-ledger-backend=sqlite",)), "refused: every replica must keep keys, limits"),
    (dict(serve_args=("--qwen-require-shared-state", "false")), "set by the fleet"),
    (dict(serve_args=("-tp", "x")), "is not a number"),
])
def test_bad_configurations_are_refused_with_what_to_do(kw, message):
    with pytest.raises(FleetError, match=message):
        check(FleetConfig(**kw))


def test_cli_splits_fleet_options_from_replica_flags_and_prints_every_command(capsys):
    _, config = config_from_args(["--replicas", "1", "--model", "/m", "--router-arg=--log-level debug", "--",
                                  "--qwen-gateway", "true"])
    assert config.serve_args == ("--model", "/m", "--qwen-gateway", "true")
    assert config.router_args == ("--log-level", "debug")
    assert main(["--replicas", "1", "--port", "9100", "--print-command", "--data-dir", "/tmp/x"]) == 0
    out = capsys.readouterr().out
    assert "# replica-0" in out and "--disable-retries" in out and "# router URL: http://127.0.0.1:9100" in out
    assert main(["--replicas", "0", "--print-command"]) == 2
    assert "error: --replicas must be at least 1" in capsys.readouterr().err


def test_preflight_refuses_missing_router_and_ports_in_use(tmp_path):
    plan = plan_of(replicas=1, port=9200, redis_url="redis://127.0.0.1:1/0")
    missing = build(FleetConfig(replicas=1, data_dir="/d"), python="/py", router_bin=str(tmp_path / "nope"),
                    redis_bin="/bin/true", cpus=(0,))
    with pytest.raises(FleetError, match=r"vllm-router is not installed .* pip install 'qwen-vllm-ext\[fleet\]'"):
        processes.preflight(missing)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        busy = build(FleetConfig(replicas=1, port=port - 1, data_dir="/d", redis_url="redis://127.0.0.1:1/0"),
                     python="/py", router_bin="/bin/true", redis_bin="/bin/true", cpus=(0,))
        with pytest.raises(FleetError, match=rf"port {port} \(replica-0\) is in use"):
            processes.preflight(busy)
    assert plan.redis is None


def test_test_fleets_draw_their_ports_below_the_ephemeral_range():
    """A fleet binds its router's ports minutes after the block was checked free: a block among the ephemeral ports
    can be taken meanwhile by an outgoing connection or a bind(0) (a CI run lost a router to exactly that)."""
    from qwen_vllm_ext.bench.server import free_port_block
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    for _ in range(20):
        base = free_port_block(5)
        assert base + 5 <= ephemeral_low and not any(processes.port_in_use(p) for p in range(base, base + 5))
