"""The import path source-patched vLLM files call (``from qwen_vllm_ext.patches.hooks import ...``); the
functions live in :mod:`qwen_vllm_ext.integration.hooks`."""
from ..integration.hooks import ACTIVE, attach_app, chat_defaults, init_state, install, scheduler_cls, server_starting

__all__ = ["ACTIVE", "attach_app", "chat_defaults", "init_state", "install", "scheduler_cls", "server_starting"]
