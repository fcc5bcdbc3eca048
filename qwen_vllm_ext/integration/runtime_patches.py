"""The one list of runtime patches: what the general plugin applies in each vLLM process.

Each capability's glue module owns its ``install(settings)`` and declares the vLLM targets it replaces or wraps
(``PATCH_TARGETS``, fingerprinted per vLLM version); this list says which setting turns each on and in which
process roles it applies. The guard (:mod:`.guard`) checks the targets before anything is applied.

Each entry is built by its own function, importing only its glue module: a source-patched vLLM module installs
one capability at the end of its own import (``hooks.install(name)``), possibly while another glue module is
still importing vLLM, so building one entry must not import the others.
"""
from __future__ import annotations

from .guard import RuntimePatch


def _usage_accounting() -> RuntimePatch:
    from ..usage import engine_hooks

    # the OpenAI front end: the output processor and the serving classes live in API-server processes
    return RuntimePatch("usage_accounting", lambda s: s.ledger and engine_hooks.install(s), {"api_server"},
                        engine_hooks.PATCH_TARGETS, "ledger")


def _per_chunk_usage() -> RuntimePatch:
    from ..usage import stream_usage

    return RuntimePatch("per_chunk_usage", stream_usage.install, {"api_server"}, stream_usage.PATCH_TARGETS,
                        "per_chunk_usage")


def _token_weighted_scheduler() -> RuntimePatch:
    from ..scheduling import patching

    return RuntimePatch("token_weighted_scheduler", patching.install, {"engine_core", "api_server"},
                        patching.PATCH_TARGETS, "token_weighted_scheduler")


def _turn_checkpoints() -> RuntimePatch:
    from ..kv import hybrid_checkpoints

    # the engine core's KV-cache manager: hybrid models keep the state where the next chat turn diverges
    return RuntimePatch("turn_checkpoints", hybrid_checkpoints.install, {"engine_core"},
                        hybrid_checkpoints.PATCH_TARGETS, "kv_turn_checkpoints")


def _kv_copies() -> RuntimePatch:
    from ..kv import state_copies

    # the model runner, in the workers (and the engine core, which checks it before attaching any state copy): vLLM's
    # block copies fixed for layers sharing a tensor, and the state copies answer checkpoints need under MTP
    return RuntimePatch("kv_copies", state_copies.install, {"worker", "engine_core"}, state_copies.PATCH_TARGETS,
                        "kv_block_copies")


def _connection_guard() -> RuntimePatch:
    from ..gateway import vllm_connections

    # vLLM's uvicorn server in each API-server process: header timeout, connection cap, open-file limit
    return RuntimePatch("connection_guard", vllm_connections.install, {"api_server"},
                        vllm_connections.PATCH_TARGETS, "connection_guard")


def _cpu_seeded_sampling() -> RuntimePatch:
    from ..sampling import cpu_seeds

    # the CPU model runner, in the workers (and the engine core when it runs the model itself)
    return RuntimePatch("cpu_seeded_sampling", cpu_seeds.install, {"worker", "engine_core"}, cpu_seeds.PATCH_TARGETS,
                        "cpu_seeded_sampling")


def _cpu_spec_decode_kernels() -> RuntimePatch:
    from ..spec import cpu_mamba_kernels

    # the model runner's fused state copies under speculative decoding, in the workers (and the engine core)
    return RuntimePatch("cpu_spec_decode_kernels", cpu_mamba_kernels.install, {"worker", "engine_core"},
                        cpu_mamba_kernels.PATCH_TARGETS, "cpu_spec_decode_kernels")


_BUILDERS = {"usage_accounting": _usage_accounting, "per_chunk_usage": _per_chunk_usage,
             "token_weighted_scheduler": _token_weighted_scheduler, "turn_checkpoints": _turn_checkpoints,
             "connection_guard": _connection_guard, "cpu_seeded_sampling": _cpu_seeded_sampling,
             "cpu_spec_decode_kernels": _cpu_spec_decode_kernels, "kv_copies": _kv_copies}


def runtime_patch(name: str) -> RuntimePatch:
    """One entry by name (LookupError for an unknown one)."""
    try:
        return _BUILDERS[name]()
    except KeyError:
        raise LookupError(f"qwen-vllm-ext: unknown runtime patch {name!r}") from None


def runtime_patches() -> list[RuntimePatch]:
    """Name, apply(settings) -> active (idempotent), process roles, guarded targets, the setting that enables it."""
    return [build() for build in _BUILDERS.values()]
