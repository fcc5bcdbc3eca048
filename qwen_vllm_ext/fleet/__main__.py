"""``python -m qwen_vllm_ext.fleet``: N replicas behind vllm-router with one shared Redis, on this host.

    python -m qwen_vllm_ext.fleet --replicas 2                        # demo model on CPU (cores split)
    python -m qwen_vllm_ext.fleet --replicas 4 --model /models/Qwen3-8B --port 8000
    python -m qwen_vllm_ext.fleet --replicas 2 --redis-url redis://10.0.0.5:6379/0 --print-command
    python -m qwen_vllm_ext.fleet --replicas 2 -- --qwen-gateway true --max-model-len 8192

Flags after ``--`` go to every replica (``python -m qwen_vllm_ext.serve``: vLLM flags, ``--profile``,
``--qwen-<setting>``); ``--router-arg=--flag`` (repeatable) goes to vllm-router. Ctrl-C or SIGTERM stops everything.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys

from .plan import DEFAULT_POLICY, POLICIES, FleetConfig, FleetError, build


def _default_data_dir() -> str:
    home = os.environ.get("QWEN_VLLM_EXT_HOME", os.path.join(os.path.expanduser("~"), ".cache", "qwen-vllm-ext"))
    return os.path.join(home, "fleet")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m qwen_vllm_ext.fleet", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=2, help="replicas of python -m qwen_vllm_ext.serve (default 2)")
    p.add_argument("--model", help="model for every replica (default: the launcher's: demo model without a GPU)")
    p.add_argument("--profile", help="launcher profile for every replica (default: from the detected GPU)")
    p.add_argument("--port", type=int, default=8000, help="the router's port; replicas use the next ones (default 8000)")
    p.add_argument("--host", default="127.0.0.1", help="the router's bind address (replicas always bind loopback)")
    p.add_argument("--redis-url", default="", help="shared Redis (default: a local redis-server, AOF in the data dir)")
    p.add_argument("--policy", default=DEFAULT_POLICY, choices=POLICIES,
                   help=f"vllm-router policy (default {DEFAULT_POLICY}: conversation affinity by x-session-id)")
    p.add_argument("--data-dir", default=_default_data_dir(), help="logs, Redis data and each replica's data dir")
    p.add_argument("--router-arg", action="append", default=[], metavar="FLAG",
                   help="extra vllm-router flag (repeatable; write --router-arg=--flag)")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds for every replica to become healthy")
    p.add_argument("--print-command", action="store_true", help="print every command line and exit")
    return p


def config_from_args(argv: list[str]) -> tuple[argparse.Namespace, FleetConfig]:
    own, serve = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = parser().parse_args(own)
    serve_args = list(serve)
    if args.model:
        serve_args = ["--model", args.model, *serve_args]
    if args.profile:
        serve_args = ["--profile", args.profile, *serve_args]
    router_args = [a for item in args.router_arg for a in item.split()]
    return args, FleetConfig(replicas=args.replicas, port=args.port, host=args.host, redis_url=args.redis_url,
                             policy=args.policy, data_dir=os.path.abspath(args.data_dir),
                             serve_args=tuple(serve_args), router_args=tuple(router_args))


def make_plan(config: FleetConfig, environ=None):
    from ..launcher.hardware import detect_gpus

    environ = os.environ if environ is None else environ
    router_bin = shutil.which("vllm-router") or os.path.join(os.path.dirname(sys.executable), "vllm-router")
    return build(config, python=sys.executable, router_bin=router_bin,
                 redis_bin=shutil.which("redis-server") or "redis-server",
                 gpus=[g.index for g in detect_gpus(environ)], cpus=sorted(os.sched_getaffinity(0)),
                 environ=dict(environ))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args, config = config_from_args(argv)
        plan = make_plan(config)
    except FleetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.print_command:
        for proc in plan.processes:
            print(f"# {proc.name}" + (f" ({proc.placement})" if proc.placement else ""))
            print(proc.command_line())
        print(f"# router URL: {plan.url}")
        return 0
    from .processes import Fleet

    fleet = Fleet(plan)

    def on_signal(signum, frame):
        fleet.request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        fleet.start(args.startup_timeout)
        print(fleet.summary(), flush=True)
        fleet.supervise()
    except FleetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        fleet.stop()
        print("fleet: stopped", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
