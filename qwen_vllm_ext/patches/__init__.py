"""Stable import paths kept for compatibility (the code lives in :mod:`qwen_vllm_ext.sourcepatch` and
:mod:`qwen_vllm_ext.integration`):

* ``python -m qwen_vllm_ext.patches ...`` -- the source-patch command (:mod:`qwen_vllm_ext.sourcepatch`);
* :mod:`.hooks` -- what a source-patched vLLM imports (:mod:`qwen_vllm_ext.integration.hooks`); the patch files
  name this path, so it never moves;
* ``qwen_vllm_ext.patches.data`` -- the patch files, as package data of an installed wheel.
"""
