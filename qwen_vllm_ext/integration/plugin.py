"""vLLM entry points of qwen-vllm-ext (vLLM's plugin loader reaches them through ``qwen_vllm_ext.plugin``).

* ``register_general`` — group ``vllm.general_plugins``: runs in EVERY vLLM process (API server,
  engine core, workers; children are spawned, so nothing is inherited): checks the vLLM version,
  applies the runtime patches idempotently, records the process state for the health route.
* ``EndpointPlugin`` — group ``vllm.endpoint_plugins``: API server only; adds ``GET /qwen_ext/health`` and
  ``POST /v1/tokens/count`` (the calculator as a service).
  vLLM loads endpoint plugins only when named in ``VLLM_PLUGINS`` (the launcher sets it).
"""
from __future__ import annotations

import logging

from .. import __version__
from ..config import Settings
from ..counting import server as counting
from ..observability import status
from ..store.locations import shared_state_problem
from .app_state import find_app_state, install_app_state
from .guard import check_patch
from .runtime_patches import runtime_patches
from .vllm_version import require_vllm, unsupported_message, version_supported

logger = logging.getLogger("qwen_vllm_ext")

PLUGIN_NAME = "qwen_vllm_ext"
HEALTH_PATH = "/qwen_ext/health"


class PatchGuardError(RuntimeError):
    """strict_patches=true and a runtime patch does not match the installed vLLM: startup fails."""


_state: dict | None = None


def patch_decision(settings: Settings, vllm_version: str) -> tuple[bool, str]:
    """Whether runtime patches may be applied in this process, and why (the version guard)."""
    if not settings.enabled:
        return False, "extension disabled by settings (enabled=false)"
    if version_supported(vllm_version):
        return True, f"vLLM {vllm_version} is supported"
    if settings.allow_unsupported_vllm:
        return True, f"vLLM {vllm_version} is unsupported; patching anyway (allow_unsupported_vllm=true)"
    return False, unsupported_message(vllm_version)


def register_general(runtime: bool = True) -> dict:
    """Entry point of ``vllm.general_plugins``. Idempotent: vLLM may call it more than once per process.

    Each wanted runtime patch first passes the compatibility guard: a target whose fingerprint does not match
    the installed vLLM disables that patch with one log line (recorded for the health route), or fails startup
    with ``strict_patches=true``. Capabilities that vLLM's source already carries (``patches/``) are reported,
    not patched again. ``runtime=False`` (a source-patched vLLM without the plugin) only records the state.
    """
    global _state
    if _state is not None:
        return _state
    settings = Settings.current()
    vllm_version = require_vllm()
    allowed, reason = patch_decision(settings, vllm_version)
    if not allowed:
        (logger.info if not settings.enabled else logger.warning)("qwen-vllm-ext: %s", reason)
    applied, source, disabled = [], [], {}
    role = status.process_role()
    if allowed and role == "engine_core":  # the scheduler's policy, passed in (also for an explicit --scheduler-cls)
        from ..scheduling.patching import bind_policy

        bind_policy(settings.scheduler, settings.token_weighted_scheduler)
    if allowed:
        for patch in runtime_patches():
            if role not in patch.roles or getattr(settings, patch.setting) in (False, "false"):
                continue
            verdict = check_patch(patch.name, patch.targets, vllm_version)
            if verdict.status == "source":
                source.append(patch.name)
            elif verdict.status == "mismatch":
                if settings.strict_patches:
                    raise PatchGuardError(f"qwen-vllm-ext: {verdict.message} (strict_patches=true: refusing to start)")
                logger.error("qwen-vllm-ext: %s", verdict.message)
                disabled[patch.name] = verdict.message
            elif runtime and patch.apply(settings):
                applied.append(patch.name)
    _state = {
        "extension_version": __version__,
        "vllm_version": vllm_version,
        "patching": allowed,
        "patching_reason": reason,
        "patch_mode": "plugin" if runtime else "source",
        "patches": applied + source,
        "source_patches": source,
        "disabled_patches": disabled,
    }
    status.record_process(_state)
    return _state


class EndpointPlugin:
    """Entry point of ``vllm.endpoint_plugins`` (vLLM instantiates it with no arguments)."""

    name = PLUGIN_NAME
    required_tasks = None

    def attach_router(self, app) -> None:
        from fastapi import APIRouter

        from fastapi.responses import JSONResponse

        router = APIRouter()
        state = install_app_state(app, Settings.current())
        settings = state.settings

        async def qwen_ext_health(request) -> JSONResponse:  # a plain Starlette route: it is handed the request
            report = health_report(app)
            return JSONResponse(report if details_allowed(request.scope, settings) else public_view(report))

        router.add_route(HEALTH_PATH, qwen_ext_health, methods=["GET"])

        problem = shared_state_problem(settings)
        if problem:  # plain `vllm serve` with the plugin: the same refusal as the launcher's
            raise RuntimeError(f"qwen-vllm-ext: {problem}")
        from . import metrics_route

        if metrics_route.wanted():  # several API-server processes: vLLM's /metrics would miss our collectors
            metrics_route.add_metrics_route(router)
        state.attached = True  # a source-patched vLLM's build_app hook then adds nothing
        _register_collectors()
        from . import stack

        _, layer_routers = stack.attach(app, state, ledger="usage_accounting" in register_general()["patches"])
        for each in (router, counting.router(state.served), *layer_routers):  # every route of the extension, here
            app.include_router(each)

    async def init_state(self, engine_client, app_state, args) -> None:
        """vLLM's ``init_app_state`` (``app_state``: the app's ``state``): every capability's state, in the declared
        start-up order (``stack.STARTUP``)."""
        from . import stack

        state = install_app_state(app_state, Settings.current())
        state.initialized = True
        await stack.init_state(state, engine_client, args)


_collectors_registered = False


class ExtensionCollector:
    """``qwen_ext_build_info`` and ``qwen_ext_runtime_patch_active`` (per patch and process role: 1 applied or carried
    by vLLM's source, 0 disabled by the compatibility guard), from the records every vLLM process of this server
    writes at plugin load (:func:`register_general`)."""

    def collect(self):
        from ..observability import catalog

        local = register_general()
        info = catalog.family("qwen_ext_build_info")
        info.add_metric([__version__, local["vllm_version"]], 1)
        yield info
        active: dict[tuple[str, str], int] = {}
        for record in status.read_processes() or [{"role": status.process_role(), **local}]:
            role = record.get("role", "?")
            for patch in record.get("patches", []):
                active[(patch, role)] = max(active.get((patch, role), 0), 1)
            for patch in record.get("disabled_patches", {}):
                active.setdefault((patch, role), 0)
        family = catalog.family("qwen_ext_runtime_patch_active")
        for (patch, role), value in sorted(active.items()):
            family.add_metric([patch, role], value)
        yield family


def _register_collectors() -> None:
    """Metrics that other processes publish (the engine core's scheduler statistics, every process's patches), once
    per process."""
    global _collectors_registered
    if not _collectors_registered:
        from ..observability import catalog
        from ..kv.metrics import KvCollector
        from ..scheduling.metrics import SchedulerCollector

        catalog.register_collector(SchedulerCollector())
        catalog.register_collector(KvCollector())
        catalog.register_collector(ExtensionCollector())
        _collectors_registered = True


def instance_id() -> str:
    from ..usage.server import instance_id as usage_instance_id

    return usage_instance_id()


def health_report(app=None) -> dict:
    """The health route's report (``app``: the API server's, for its KV-reuse state)."""
    from ..gateway.vllm_connections import status as connections_status
    from ..kv.server import status as kv_status
    from ..scheduling.metrics import scheduler_status

    local = register_general()
    state = find_app_state(app) if app is not None else None
    processes = status.read_processes()
    roles = sorted({p["role"] for p in processes})
    return {
        "extension": PLUGIN_NAME,
        "version": __version__,
        "vllm_version": local["vllm_version"],
        "patching": local["patching"],
        "patching_reason": local["patching_reason"],
        "features": {"patches": local["patches"]},
        "patch_mode": local["patch_mode"],
        "source_patches": local["source_patches"],
        "disabled_patches": local["disabled_patches"],
        "instance_id": instance_id(),
        "plugin_loaded_in": roles,
        "scheduler": scheduler_status(),
        "kv_reuse": kv_status(state.kv if state is not None else None),
        "connections": connections_status(),
        # None without the ledger; ready false while its writer is stopped or spilling (reported, not a failed probe)
        "ledger": state.usage.health() if state is not None and state.usage is not None else None,
        "processes": processes,
        "settings": (state.settings if state is not None else Settings.current()).public(),
        "launch": _launch(),
    }


DETAIL_FIELDS = ("processes", "launch", "instance_id")
"""Parts of the health report only the admin sees when the gateway is on: pids, paths, the host-derived instance id,
the launch record; ``settings`` shrinks to its on/off switches."""
PRIVATE_KEYS = frozenset({"pid", "pids", "spill_dir", "data_dir", "path", "instance_dir"})
"""Keys dropped from every section of the public view (pids and paths the scheduler and ledger sections carry)."""
DETAILS_NOTE = ("settings, processes, the instance id and the launch record are shown with 'Authorization: Bearer "
                "<admin_key>' (the gateway is on)")


def details_allowed(scope, settings: Settings) -> bool:
    """The whole report goes to anyone when the gateway is off (nothing on the server asks for a key then), else only
    to a request carrying the admin key."""
    if not settings.gateway:
        return True
    from ..gateway.middleware import check_admin

    return check_admin(scope, settings.admin_key)


def public_view(report: dict) -> dict:
    """The health report without what only an operator should read (:data:`DETAIL_FIELDS`, :data:`PRIVATE_KEYS`); the
    settings reduced to their booleans (which capabilities are on), so a doctor without the admin key still knows."""
    def scrub(value):
        if isinstance(value, dict):
            return {k: scrub(v) for k, v in value.items() if k not in PRIVATE_KEYS}
        if isinstance(value, list):
            return [scrub(v) for v in value]
        return value

    out = {k: scrub(v) for k, v in report.items() if k not in DETAIL_FIELDS and k != "settings"}
    out["settings"] = {k: v for k, v in (report.get("settings") or {}).items() if isinstance(v, bool)}
    out["details"] = DETAILS_NOTE
    return out


def _launch() -> dict | None:
    """The launcher's profile and the GPUs it detected (None: not started by ``python -m qwen_vllm_ext.serve``)."""
    import json
    import os

    raw = os.environ.get(status.LAUNCH_ENV)
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return None
