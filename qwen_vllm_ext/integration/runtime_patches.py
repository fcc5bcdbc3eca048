"""The one list of runtime patches: what the general plugin applies in each vLLM process.

Each capability's glue module owns its ``install(settings)`` and declares the vLLM targets it replaces or wraps
(``PATCH_TARGETS``, fingerprinted per vLLM version); this list says which setting turns each on and in which
process roles it applies. The guard (:mod:`.guard`) checks the targets before anything is applied.
"""
from __future__ import annotations

from .guard import RuntimePatch


def runtime_patches() -> list[RuntimePatch]:
    """Name, apply(settings) -> active (idempotent), process roles, guarded targets, the setting that enables it."""
    from ..scheduling import vllm_scheduler
    from ..usage import engine_hooks, stream_usage

    return [
        # the OpenAI front end: the output processor and the serving classes live in API-server processes
        RuntimePatch("usage_accounting", lambda s: s.ledger and engine_hooks.install(s), {"api_server"},
                     engine_hooks.PATCH_TARGETS, "ledger"),
        RuntimePatch("per_chunk_usage", stream_usage.install, {"api_server"}, stream_usage.PATCH_TARGETS,
                     "per_chunk_usage"),
        RuntimePatch("token_weighted_scheduler", vllm_scheduler.install, {"engine_core", "api_server"},
                     vllm_scheduler.PATCH_TARGETS, "token_weighted_scheduler"),
    ]
