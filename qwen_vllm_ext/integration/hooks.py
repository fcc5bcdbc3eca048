"""Functions that the source patches (``patches/vllm-<version>/``) call from inside vLLM's own files.

A source-patched vLLM runs the extension without vLLM's plugin loader (no ``vllm.general_plugins`` /
``vllm.endpoint_plugins`` entry points): each patch adds one marked, explicit call to a function below at the
place it changes. The functions run the same glue code as the plugin path (one source of truth), read the same
settings (``QWEN_VLLM_EXT_*`` environment variables, ``Settings.current()``), and do nothing with
``enabled=false``. When the plugin is loaded as well, every step is idempotent: nothing happens twice.
"""
from __future__ import annotations

import logging

logger = logging.getLogger("qwen_vllm_ext.patches")

# name -> active, for the capabilities installed in this process by a source patch
ACTIVE: dict[str, bool] = {}


def _settings():
    from ..config import Settings

    return Settings.current()


def install(name: str) -> bool:
    """Install capability ``name`` (``usage_accounting``, ``per_chunk_usage``, ``connection_guard``…) in this process.

    Called at the end of the patched vLLM module that owns the wrapped code, right after its classes exist.
    """
    from .runtime_patches import runtime_patch

    settings = _settings()
    active = False
    if settings.enabled:
        try:
            patch = runtime_patch(name)
        except LookupError:
            raise LookupError(f"qwen-vllm-ext: the source patch names an unknown capability {name!r}") from None
        active = bool(patch.apply(settings))
    ACTIVE[name] = active
    return active


def scheduler_cls(scheduler_config):
    """Scheduler class for ``SchedulerConfig.get_scheduler_cls()`` when ``--scheduler-cls`` is unset:
    the token-weighted scheduler with ``token_weighted_scheduler`` true or auto, else None (vLLM's default)."""
    settings = _settings()
    if not settings.enabled:
        return None
    from ..scheduling.patching import bind_policy
    from ..scheduling.vllm_scheduler import pick_scheduler_cls

    bind_policy(settings.scheduler, settings.token_weighted_scheduler)  # a source-patched engine core: bound here
    return pick_scheduler_cls(scheduler_config) if settings.token_weighted_scheduler != "false" else None


def server_starting() -> None:
    """API server start, before the engine is spawned: fix the instance directory every process of this
    server shares (process records, scheduler statistics for the health route)."""
    from ..observability import status

    if _settings().enabled:
        status.instance_dir()


def attach_app(app) -> None:
    """``build_app``: the extension's routes and middlewares (health, token counting, gateway, ledger),
    exactly as the endpoint plugin adds them; skipped when the endpoint plugin already did."""
    from .app_state import find_app_state

    found = find_app_state(app)
    if not _settings().enabled or (found is not None and found.attached):
        return
    from . import plugin

    plugin.register_general(runtime=False)  # the state the health route reports; patches nothing
    plugin.EndpointPlugin().attach_router(app)


async def init_state(engine_client, state, args) -> None:
    """``init_app_state``: the extension's per-server state, as the endpoint plugin sets it."""
    from .app_state import find_app_state

    found = find_app_state(state)
    if not _settings().enabled or (found is not None and found.initialized):
        return
    from . import plugin

    await plugin.EndpointPlugin().init_state(engine_client, state, args)


def chat_defaults(args) -> None:
    """``init_app_state``, before the chat template is loaded: with ``kv_reuse_template`` (default on) and no
    ``--chat-template``, a Qwen3 hybrid-thinking or Qwen3.5/3.6 model gets the package's prefix-stable template
    and default ``chat_template_kwargs`` — the same choice the launcher makes (``qwen_vllm_ext.kv.reuse.launcher_flags``)."""
    import json

    from ..kv import reuse

    settings = _settings()
    if not settings.enabled:
        return
    given = {name for name in ("chat_template", "default_chat_template_kwargs") if getattr(args, name, None)}
    flags, note = reuse.launcher_flags(settings.kv_reuse_template, args.model, given)
    for flag, value in zip(flags[::2], flags[1::2]):
        if flag == "--chat-template":
            args.chat_template = value
        elif flag == "--default-chat-template-kwargs":
            args.default_chat_template_kwargs = json.loads(value)
    logger.info("qwen-vllm-ext: KV-reuse chat template %s", note)
