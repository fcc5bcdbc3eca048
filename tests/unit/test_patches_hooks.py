"""Unit tests of the source-patch hooks that need no vLLM (the KV-reuse chat-template default)."""
from argparse import Namespace

import pytest
from qwen_v3_calculator.chat import template_path

from qwen_vllm_ext.config import RESOLVED_ENV
from qwen_vllm_ext.integration import hooks


@pytest.fixture
def env(monkeypatch):
    monkeypatch.delenv(RESOLVED_ENV, raising=False)
    for name in ("ENABLED", "KV_REUSE_TEMPLATE"):
        monkeypatch.delenv(f"QWEN_VLLM_EXT_{name}", raising=False)
    return monkeypatch


def _args(model="Qwen/Qwen3-8B", **kw):
    return Namespace(model=model, chat_template=kw.get("chat_template"),
                     default_chat_template_kwargs=kw.get("default_chat_template_kwargs"))


def test_qwen3_gets_the_prefix_stable_template_like_the_launcher(env):
    args = _args()
    hooks.chat_defaults(args)
    assert args.chat_template == template_path("qwen3-reuse")
    assert args.default_chat_template_kwargs == {"preserve_thinking": True}


def test_user_choices_and_settings_win(env):
    args = _args(chat_template="/srv/my.jinja")
    hooks.chat_defaults(args)
    assert args.chat_template == "/srv/my.jinja" and args.default_chat_template_kwargs is None

    args = _args(default_chat_template_kwargs={"enable_thinking": False})
    hooks.chat_defaults(args)
    assert args.chat_template == template_path("qwen3-reuse")
    assert args.default_chat_template_kwargs == {"enable_thinking": False}

    args = _args(model="meta-llama/Llama-3.1-8B-Instruct")
    hooks.chat_defaults(args)
    assert args.chat_template is None

    env.setenv("QWEN_VLLM_EXT_KV_REUSE_TEMPLATE", "false")
    args = _args()
    hooks.chat_defaults(args)
    assert args.chat_template is None

    env.setenv("QWEN_VLLM_EXT_KV_REUSE_TEMPLATE", "true")
    env.setenv("QWEN_VLLM_EXT_ENABLED", "false")
    args = _args()
    hooks.chat_defaults(args)
    assert args.chat_template is None
