"""The launcher's KV-reuse flags against vLLM's real argument parser (no server started)."""
import pytest

from qwen_v3_calculator.chat import template_path
from qwen_vllm_ext import serve
from qwen_vllm_ext.launcher.hardware import parse_nvidia_smi
from qwen_vllm_ext.kv.reuse import served_template

from ..helpers.hardware import NVIDIA_SMI_LINES

A100 = parse_nvidia_smi(NVIDIA_SMI_LINES["a100-80gb"])


def test_qwen3_gets_the_reuse_template_and_gpu_profiles_offload():
    args, final, *_ = serve.resolve(["--model", "Qwen/Qwen3-8B"], environ={}, gpus=A100)
    assert args.chat_template == template_path()
    assert args.default_chat_template_kwargs == {"preserve_thinking": True}
    assert (args.kv_offloading_size, args.kv_offloading_backend) == (64, "native")
    assert not args.enable_sleep_mode
    assert served_template(args) == "qwen3-reuse"  # what the server's calculator (and gateway) counts with


def test_stock_and_user_templates_and_other_models(tmp_path):
    mine = tmp_path / "mine.jinja"
    mine.write_text("{{ messages }}")
    args, *_ = serve.resolve(["--model", "Qwen/Qwen3-8B", "--qwen-kv-reuse-template", "false"], environ={}, gpus=A100)
    assert args.chat_template is None and served_template(args) is None
    args, *_ = serve.resolve(["--model", "Qwen/Qwen3-8B", "--chat-template", str(mine)], environ={}, gpus=A100)
    assert args.chat_template == str(mine)
    args, *_ = serve.resolve(["--model", "Qwen/Qwen2.5-7B-Instruct"], environ={}, gpus=A100)
    assert args.chat_template is None
    args, *_ = serve.resolve(["--model", "Qwen/Qwen3-8B", "--default-chat-template-kwargs",
                              '{"preserve_thinking": false}'], environ={}, gpus=A100)
    assert args.chat_template == template_path() and served_template(args) == "qwen3"  # renders as stock


def test_demo_model_on_cpu_gets_the_reuse_template():
    args, *_ = serve.resolve([], environ={}, gpus=[])
    assert args.chat_template == template_path() and args.kv_offloading_size is None


def test_qwen35_family_gets_the_qwen35_reuse_template():
    """Qwen3.5/3.6 (a hub id on a GPU profile, the hybrid demo on CPU): ``qwen3.5-reuse``, counted with its mirror;
    off, the official template (and the engine keeps no answer states: ``answer_checkpoints_apply``)."""
    q35 = template_path("qwen3.5-reuse")
    for model, gpus in (("Qwen/Qwen3.6-35B-A3B", A100), ("qwen36-demo", [])):
        args, *_ = serve.resolve(["--model", model], environ={}, gpus=gpus)
        assert args.chat_template == q35 and args.default_chat_template_kwargs == {"preserve_thinking": "answers"}
        assert served_template(args) == "qwen3.5-reuse"
    args, *_ = serve.resolve(["--model", "qwen36-demo", "--default-chat-template-kwargs",
                              '{"preserve_thinking": false}'], environ={}, gpus=[])
    assert served_template(args) == "qwen3.5"  # renders as the official template
    args, *_ = serve.resolve(["--model", "qwen36-demo", "--qwen-kv-reuse-template", "false"], environ={}, gpus=[])
    assert args.chat_template is None and served_template(args) is None


def test_idle_sleep_flags_and_refusals():
    args, *_ = serve.resolve(["--model", "Qwen/Qwen3-8B", "--qwen-idle-sleep-s", "300", "--print-command"],
                             environ={}, gpus=A100)
    assert args.enable_sleep_mode
    with pytest.raises(serve.LaunchError, match="single API-server process"):
        serve.resolve(["--model", "Qwen/Qwen3-8B", "--qwen-idle-sleep-s", "300", "--print-command",
                       "--api-server-count", "2"], environ={}, gpus=A100)
    with pytest.raises(serve.LaunchError, match="this platform does not support"):  # the CPU profile
        serve.resolve(["--qwen-idle-sleep-s", "300"], environ={}, gpus=[])
    with pytest.raises(serve.LaunchError, match="is_sleep_mode_available"):  # a GPU profile on this CPU-only vLLM
        serve.resolve(["--model", "Qwen/Qwen3-8B", "--qwen-idle-sleep-s", "300"], environ={}, gpus=A100)
