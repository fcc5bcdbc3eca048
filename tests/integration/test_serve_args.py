"""The launcher against vLLM's real argument parser (vLLM installed; no server started)."""
import os
import subprocess
import sys

import pytest

from qwen_vllm_ext import serve
from qwen_vllm_ext.launcher.hardware import parse_nvidia_smi
from qwen_vllm_ext.profiles import ProfileError, load_profile, profile_names

from ..helpers.hardware import NVIDIA_SMI_LINES

GPU_FOR = {"a100-80gb": "a100-80gb", "h100-80gb": "h100-80gb", "h200-141gb": "h200-141gb", "cpu": None}


@pytest.mark.parametrize("name", profile_names())
def test_every_profile_is_accepted_by_vllm_parser(name):
    gpus = parse_nvidia_smi(NVIDIA_SMI_LINES[GPU_FOR[name]]) if GPU_FOR[name] else []
    args, final, env, profile, settings = serve.resolve(["--model", "Qwen/Qwen3-8B"], environ={}, gpus=gpus)
    assert profile.name == name
    for flag, value in load_profile(name).vllm.items():
        assert getattr(args, flag.replace("-", "_")) == value, flag
    assert env["VLLM_PLUGINS"].split(",")[-1] == "qwen_vllm_ext"
    assert settings.enabled


def test_user_flags_override_profile_including_aliases():
    gpus = parse_nvidia_smi(NVIDIA_SMI_LINES["a100-80gb"])
    args, final, *_ = serve.resolve(
        ["--model", "Qwen/Qwen3-8B", "--max-model-len", "4096", "-tp", "2", "--no-enable-prefix-caching",
         "--max_num_seqs=64"], environ={}, gpus=gpus)
    assert (args.max_model_len, args.tensor_parallel_size, args.enable_prefix_caching, args.max_num_seqs) == (4096, 2, False, 64)
    assert "32768" not in final and "--tensor-parallel-size" not in final and "--enable-prefix-caching" not in final
    assert args.max_num_batched_tokens == 8192  # untouched profile flags stay


def test_prompt_tokens_details_on_by_default_unless_the_user_or_stock_usage_says_otherwise():
    """Issue 46: cached tokens on every response; --no-enable-prompt-tokens-details and per_chunk_usage=false win."""
    args, final, *_ = serve.resolve(["--model", "Qwen/Qwen3-8B"], environ={}, gpus=[])
    assert args.enable_prompt_tokens_details is True and final.count("--enable-prompt-tokens-details") == 1
    args, final, *_ = serve.resolve(["--model", "Qwen/Qwen3-8B", "--no-enable-prompt-tokens-details"], environ={},
                                    gpus=[])
    assert args.enable_prompt_tokens_details is False and "--enable-prompt-tokens-details" not in final
    args, final, *_ = serve.resolve(["--model", "Qwen/Qwen3-8B", "--qwen-per-chunk-usage", "false"], environ={},
                                    gpus=[])
    assert args.enable_prompt_tokens_details is False


def test_plugin_allowlist_keeps_vllms_own_plugins():
    names = serve.plugin_allowlist(None).split(",")
    assert "qwen_vllm_ext" in names and "lora_filesystem_resolver" in names
    assert serve.plugin_allowlist("mine") == "mine,qwen_vllm_ext"
    assert serve.plugin_allowlist("qwen_vllm_ext,x") == "qwen_vllm_ext,x"


def test_extension_settings_flags_and_additional_config():
    args, final, env, profile, settings = serve.resolve(
        ["--qwen-data-dir", "/cli", "--additional-config", '{"qwen_vllm_ext": {"enabled": false}}'],
        environ={"QWEN_VLLM_EXT_DATA_DIR": "/env"}, gpus=[])
    assert settings.data_dir == "/cli" and settings.enabled is False


def test_refusals():
    with pytest.raises(serve.LaunchError, match="no model given"):
        serve.resolve([], environ={}, gpus=parse_nvidia_smi(NVIDIA_SMI_LINES["a100-80gb"]))
    with pytest.raises(serve.LaunchError, match="model path '/nonexistent/Qwen3-8B' does not exist"):
        serve.resolve(["--model", "/nonexistent/Qwen3-8B"], environ={}, gpus=[])
    with pytest.raises(ProfileError, match="MIG"):
        serve.resolve(["--model", "Qwen/Qwen3-8B"], environ={}, gpus=parse_nvidia_smi(NVIDIA_SMI_LINES["a100-mig"]))


def cli(*argv, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "qwen_vllm_ext.serve", *argv], capture_output=True, text=True,
                          timeout=300, env=env)


def test_print_command_a100_without_gpu(tmp_path):
    proc = cli("--profile", "a100-80gb", "--model", "Qwen/Qwen3-8B", "--print-command",
               env_extra={"QWEN_VLLM_EXT_NVIDIA_SMI": str(tmp_path / "none")})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for line in ("--max-model-len 32768", "--max-num-seqs 256", "--max-num-batched-tokens 8192", "--block-size 16",
                 "--enable-chunked-prefill", "--enable-prefix-caching", "--tensor-parallel-size 1",
                 "--pipeline-parallel-size 1", "--model Qwen/Qwen3-8B"):
        assert line in lines
    assert any(line.startswith("# env VLLM_PLUGINS=") and "qwen_vllm_ext" in line for line in lines)


def test_cli_errors_are_clear(fake_nvidia_smi):
    proc = cli("--profile", "nope", "--print-command")
    assert proc.returncode == 2 and "unknown profile 'nope'; known profiles: a100-80gb, cpu" in proc.stderr
    smi = fake_nvidia_smi(NVIDIA_SMI_LINES["a100-mig"])
    proc = cli("--model", "Qwen/Qwen3-8B", "--print-command", env_extra={"QWEN_VLLM_EXT_NVIDIA_SMI": smi})
    assert proc.returncode == 2 and "MIG enabled" in proc.stderr
    proc = cli("--profile", "a100-80gb", "--model", "Qwen/Qwen3-8B", env_extra={"QWEN_VLLM_EXT_NVIDIA_SMI": "/none"})
    assert proc.returncode == 2 and "needs an NVIDIA GPU" in proc.stderr
    proc = cli("--list-profiles")
    assert proc.returncode == 0 and "a100-80gb" in proc.stdout and "A100 >= 79 GiB" in proc.stdout


def test_what_the_settings_alone_rule_out_is_refused_before_vllm_loads():
    """A bad setting costs the user a second, not vLLM's import (a dozen seconds here); what needs vLLM's flags (the
    listing's context against --max-model-len) is still refused, after the parser."""
    code = ("import sys; from qwen_vllm_ext import serve; rc = serve.main(sys.argv[1:]); "
            "print(rc, 'vllm' in sys.modules)")
    for argv, setting in ((["--qwen-max-queue-wait-s", "2"], "max_queue_wait_s"),
                          (["--qwen-openrouter", "true"], "price_prompt"),
                          (["--qwen-require-shared-state", "true"], "require_shared_state")):
        proc = subprocess.run([sys.executable, "-c", code, *argv, "--print-command"], capture_output=True, text=True,
                              timeout=120)
        assert proc.stdout.split() == ["2", "False"] and setting in proc.stderr, (argv, proc.stdout, proc.stderr)
    with pytest.raises(serve.LaunchError, match="setting 'listing_context_length': 5000 is more than the engine's "
                                                "--max-model-len 4096"):
        serve.resolve(["--qwen-openrouter", "true", "--qwen-price-prompt", "0.1",
                       "--qwen-listing-context-length", "5000"], environ={}, gpus=[])


def test_a_redis_store_nobody_answers_at_is_refused_before_vllm_loads():
    """A Redis ledger or limiter URL that does not answer: the launcher refuses naming the setting, in a second, not
    after the engine loaded the model (minutes on a GPU); resolving the command alone (--print-command) does not
    connect; a Redis that answers passes."""
    from qwen_vllm_ext.config import Settings
    from qwen_vllm_ext.store.locations import unreachable_store

    from ..redis_server import RedisServer, free_port

    dead = f"redis://127.0.0.1:{free_port()}/0"
    code = ("import sys; from qwen_vllm_ext import serve; rc = serve.main(sys.argv[1:]); "
            "print(rc, 'vllm' in sys.modules)")
    for argv, setting in ((["--qwen-ledger-backend", "redis", "--qwen-ledger-redis-url", dead], "ledger_redis_url"),
                          (["--qwen-gateway", "true", "--qwen-admin-key", "k" * 16, "--qwen-limiter-backend", "redis",
                            "--qwen-limiter-redis-url", dead], "limiter_redis_url")):
        proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
        assert proc.stdout.split() == ["2", "False"], (argv, proc.stdout, proc.stderr)
        assert f"setting '{setting}': cannot reach the Redis" in proc.stderr and dead in proc.stderr, proc.stderr
        serve.resolve([*argv, "--print-command"], environ={}, gpus=[])  # resolving alone connects to nothing
    # a limiter URL is only used with the gateway on: without it nothing is refused
    assert unreachable_store(Settings(limiter_backend="redis", limiter_redis_url=dead)) is None
    redis = RedisServer().start()
    try:
        assert unreachable_store(Settings(ledger_backend="redis", ledger_redis_url=redis.url, gateway=True,
                                          limiter_backend="redis")) is None
    finally:
        redis.cleanup()


def test_cpu_data_parallel_engines_get_their_own_cores():
    """vLLM's auto binding puts every DP engine of a one-NUMA CPU host on the same cores; the launcher splits them."""
    from qwen_vllm_ext.launcher.hardware import split_cores

    cores = os.sched_getaffinity(0)
    dp2 = ["--model", "Qwen/Qwen3-8B", "--data-parallel-size", "2"]
    env = serve.resolve(dp2, environ={}, gpus=[])[2]
    if len(cores) >= 2:
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == "|".join(",".join(map(str, p)) for p in split_cores(cores, 2))
        assert len(env["VLLM_CPU_OMP_THREADS_BIND"].split("|")) == 2
    else:
        assert "VLLM_CPU_OMP_THREADS_BIND" not in env  # one core: nothing to split
    assert "VLLM_CPU_OMP_THREADS_BIND" not in serve.resolve(dp2, environ={"VLLM_CPU_OMP_THREADS_BIND": "nobind"},
                                                             gpus=[])[2]
    assert "VLLM_CPU_OMP_THREADS_BIND" not in serve.resolve(["--model", "Qwen/Qwen3-8B"], environ={}, gpus=[])[2]
    a100 = parse_nvidia_smi(NVIDIA_SMI_LINES["a100-80gb"])
    assert "VLLM_CPU_OMP_THREADS_BIND" not in serve.resolve(dp2, environ={}, gpus=a100)[2]


def test_a_fleet_replica_refuses_per_host_state():
    """require_shared_state (set by the fleet and the Kubernetes manifests): SQLite keys/limits/ledger are refused."""
    with pytest.raises(serve.LaunchError, match=r"require_shared_state is on .* ledger_backend \(ledger and API keys\) "
                                                r"is sqlite; limiter_backend is sqlite"):
        serve.resolve(["--model", "Qwen/Qwen3-8B", "--qwen-require-shared-state", "true"], environ={}, gpus=[])
    with pytest.raises(serve.LaunchError, match="limiter_backend is sqlite"):
        serve.resolve(["--model", "Qwen/Qwen3-8B", "--qwen-require-shared-state", "true", "--qwen-ledger-backend",
                       "redis", "--qwen-ledger-redis-url", "redis://127.0.0.1:6379/0"], environ={}, gpus=[])
    args, *_ = serve.resolve(["--model", "Qwen/Qwen3-8B", "--qwen-require-shared-state", "true", "--qwen-ledger-backend",
                              "redis", "--qwen-limiter-backend", "redis", "--qwen-ledger-redis-url",
                              "redis://127.0.0.1:6379/0"], environ={}, gpus=[])
    assert args.model == "Qwen/Qwen3-8B"


def test_the_qwen36_demo_and_family_flags():
    """``--model qwen36-demo``: the cached hybrid demo, bf16 (the CPU Gated DeltaNet kernels), the family's parsers and
    prefix match unit; a float32 request for it is refused with the fix; user flags win."""
    args, final, *_ = serve.resolve(["--model", "qwen36-demo"], environ={}, gpus=[])
    assert args.dtype == "bfloat16" and args.served_model_name == ["qwen36-demo"]
    assert args.reasoning_parser == "qwen3" and args.tool_call_parser == "qwen3_coder" and args.enable_auto_tool_choice
    assert args.prefix_match_unit == 16 and "qwen36-tiny-demo" in args.model
    with pytest.raises(serve.LaunchError, match="bfloat16"):
        serve.resolve(["--model", "qwen36-demo", "--dtype", "float32"], environ={}, gpus=[])
    args, *_ = serve.resolve(["--model", "qwen36-demo", "--prefix-match-unit", "32", "--reasoning-parser", "deepseek_r1",
                              "--no-enable-prefix-caching"], environ={}, gpus=[])
    assert args.prefix_match_unit == 32 and args.reasoning_parser == "deepseek_r1"
    args, *_ = serve.resolve(["--model", "qwen36-demo", "--no-enable-prefix-caching"], environ={}, gpus=[])
    assert args.prefix_match_unit is None
    args, *_ = serve.resolve(["--model", "qwen36-demo", "--block-size", "8"], environ={}, gpus=[])
    assert args.prefix_match_unit is None  # 16 does not divide 8: vLLM would refuse to start
    dense, *_ = serve.resolve([], environ={}, gpus=[])  # the Qwen3 demo is served as before: no parsers
    assert dense.dtype == "float32" and not dense.reasoning_parser and dense.prefix_match_unit is None
    # the hybrid demo's context fits 10-turn conversations; the dense demo keeps the profile's; the user's wins
    assert args.max_model_len == serve.DEMO_CONTEXT["qwen36-demo"] == 16384 and dense.max_model_len == 4096
    args, *_ = serve.resolve(["--model", "qwen36-demo", "--max-model-len", "8192"], environ={}, gpus=[])
    assert args.max_model_len == 8192


def test_mtp_switch_on_the_mtp_demo_and_refused_without_mtp_weights():
    """Issue 49: --qwen-mtp-speculative-tokens N turns MTP on for a checkpoint with MTP layers (the MTP demo), shown
    by --print-command; a checkpoint without them is refused at start with the reason; off by default."""
    import json

    args, final, *_ = serve.resolve(["--model", "qwen36-mtp-accept", "--qwen-mtp-speculative-tokens", "2"],
                                    environ={}, gpus=[])
    assert json.loads(final[final.index("--speculative-config") + 1]) == {"method": "mtp", "num_speculative_tokens": 2}
    assert args.served_model_name == ["qwen36-mtp-accept"] and args.max_model_len == 16384
    args, final, *_ = serve.resolve(["--model", "qwen36-mtp-accept"], environ={}, gpus=[])
    assert "--speculative-config" not in final  # off unless asked
    own = '{"method": "mtp", "num_speculative_tokens": 1}'
    args, final, *_ = serve.resolve(["--model", "qwen36-mtp-accept", "--speculative-config", own,
                                     "--qwen-mtp-speculative-tokens", "3"], environ={}, gpus=[])
    assert final.count("--speculative-config") == 1 and own in final
    with pytest.raises(serve.LaunchError, match="declares no MTP layers"):
        serve.resolve(["--model", "qwen36-demo", "--qwen-mtp-speculative-tokens", "2"], environ={}, gpus=[])
    # the user's own MTP config on a checkpoint without MTP weights: refused at once (vLLM starts the engine and
    # fails ~40 s later with "Following weights were not initialized from checkpoint")
    for method in ("mtp", "qwen3_next_mtp"):
        with pytest.raises(serve.LaunchError, match=f"method '{method}' drafts with the checkpoint's own MTP layers"):
            serve.resolve(["--model", "qwen36-demo", "--speculative-config",
                           json.dumps({"method": method, "num_speculative_tokens": 1})], environ={}, gpus=[])
    # a method vLLM does not know: refused at start, naming the ones it does
    with pytest.raises(serve.LaunchError, match="method 'qwen_mtp' is not one this vLLM knows: .*mtp.*ngram"):
        serve.resolve(["--model", "qwen36-mtp-accept", "--speculative-config",
                       '{"method": "qwen_mtp", "num_speculative_tokens": 1}'], environ={}, gpus=[])
    assert {"mtp", "qwen3_next_mtp", "ngram", "eagle3"} <= serve.speculative_methods()
    # other methods are vLLM's to check
    args, final, *_ = serve.resolve(["--model", "qwen36-demo", "--speculative-config",
                                     '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}'],
                                    environ={}, gpus=[])
    assert args.speculative_config["method"] == "ngram"
    from qwen_vllm_ext.config import SettingsError

    with pytest.raises(SettingsError, match="mtp_speculative_tokens"):
        serve.resolve(["--model", "qwen36-mtp-accept", "--qwen-mtp-speculative-tokens", "-1"], environ={}, gpus=[])
