"""vLLM source patches (``patches/vllm-<version>/``) and the runtime patches' compatibility guard.

* :mod:`.core`         find the vLLM sources, check / apply (all-or-nothing, backup) / revert — pure Python
* :mod:`.applier`      the strict unified-diff applier it uses
* :mod:`.fingerprints` fingerprints of the vLLM functions a runtime patch wraps; the startup guard
* :mod:`.hooks`        the functions the source patches call from inside vLLM (same glue as the plugin path)
* :mod:`.recipes`      the edits the patch files are generated from (``patches/regen.py``)

CLI: ``python -m qwen_vllm_ext.patches list|check|apply|revert|fingerprints [--vllm-path DIR]``.
"""
