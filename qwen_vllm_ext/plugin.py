"""vLLM's entry points name this module (``qwen_vllm_ext.plugin:register_general`` and ``:EndpointPlugin``); the
code lives in :mod:`qwen_vllm_ext.integration.plugin`."""
from .integration.plugin import (PLUGIN_NAME, EndpointPlugin, PatchGuardError, health_report, instance_id,
                                 patch_decision, register_general)
from .integration.runtime_patches import runtime_patches

__all__ = ["PLUGIN_NAME", "EndpointPlugin", "PatchGuardError", "health_report", "instance_id", "patch_decision",
           "register_general", "runtime_patches"]
