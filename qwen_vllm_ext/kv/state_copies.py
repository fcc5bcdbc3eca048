"""vLLM glue (model runner, worker process): the KV-cache copies the worker runs for prefix caching (runtime patch
``kv_copies``): vLLM's block copies, fixed for layers that share a tensor, and the recurrent-state copies answer
checkpoints need under speculative decoding (the engine-core side is :mod:`.hybrid_checkpoints`).

**Block copies** (setting ``kv_block_copies``). vLLM 0.32's ``copy_kv_cache_blocks_inplace`` (the copy-on-write of a
partial-block prefix hit, among others) copies, per tensor address, the first layer view it meets, and whole pages
only when a tensor holds one layer. Under MTP a hybrid model's KV-cache groups put two layers in one tensor (e.g.
``[GDN 0, GDN 2]``, ``[attention 3, the MTP layer]``), so the attention layer's view starts where a Gated DeltaNet
view does and was skipped: the GDN view's bytes were copied (the unpadded recurrent state, less than a page), the
rest of the attention page stayed as the zeroed new block. Every prefix hit inside a block then read part of the
value cache as zeros, and greedy outputs diverged from an uncached request within a few tokens. :func:`copy_blocks`
copies, per (address, block stride), every byte any view there uses. It replaces the name in the V1 model runner's
module (the CPU runner and the GPU default); vLLM's V2 model runner (``vllm/v1/worker/gpu/model_runner.py``) keeps
its own import. Upstream's fix is open (vllm PR #55112).

Under speculative decoding (MTP) a decode step of a hybrid model verifies ``1 + k`` tokens; vLLM's Gated DeltaNet
kernels write the recurrent (temporal) state after each of them to consecutive state columns of the request
(``col, col + 1, …``), and keep one convolution window in column ``col``, ``k`` entries wider than the kernel needs,
which the next step reads at offset ``accepted - 1``. So the state after the ``b + 1``-th token of a step is
``temporal = column col + b`` and ``conv = column col's window shifted left by b`` — the reading vLLM's own state
copies use (``get_temporal_copy_spec``, ``get_conv_copy_spec`` with ``num_accepted_tokens = b + 1``, and the fused
``precopy``/``postprocess`` kernels' ``token_bias``). A whole-block copy (vLLM's copy-on-write queue) cannot express
it: the scheduler attaches the copies to the step's ``SchedulerOutput`` (attribute :data:`ATTR`, tuples ``(group,
conv source block, temporal source block, destination block, b)``) and this module runs them on the worker at the
start of the step, before vLLM's own block copies and zeroing (a same-step hit copies the destination on) and before
the forward pass overwrites the sources.
"""
from __future__ import annotations

import functools
import logging
import sys

logger = logging.getLogger("vllm.qwen_vllm_ext.kv")

_MARK = "_qwen_vllm_ext_answer_state_copies"
ATTR = "qwen_mamba_state_copies"
RUNNER = "vllm.v1.worker.gpu_model_runner"
MAMBA = "vllm.model_executor.layers.mamba.mamba_utils"

# Compatibility guard (qwen_vllm_ext.integration.guard): the runner method wrapped, and the copy-spec functions
# whose reading of the state columns the copies reproduce (they identify each state tensor as conv or temporal).
PATCH_TARGETS = {
    # replaced in the runner's namespace, which imported it by name
    "vllm.v1.worker.utils:copy_kv_cache_blocks_inplace": {"0.32.0": "d97f1071bebb2265", "0.33.0": "d97f1071bebb2265"},
    f"{RUNNER}:GPUModelRunner._update_states": {"0.32.0": "2eb2df8682212b24", "0.33.0": "2eb2df8682212b24"},
    f"{MAMBA}:get_conv_copy_spec": {"0.32.0": "3c51a757d6ed5552", "0.33.0": "3c51a757d6ed5552"},
    f"{MAMBA}:get_temporal_copy_spec": {"0.32.0": "607fa1197ce4f877", "0.33.0": "607fa1197ce4f877"},
}

CONV, TEMPORAL = "conv", "temporal"


def state_kinds(copy_funcs) -> tuple[str, ...] | None:
    """The kind of each state tensor from a mamba type's vLLM copy functions (None: one this module cannot copy)."""
    from vllm.model_executor.layers.mamba import mamba_utils

    known = {mamba_utils.get_conv_copy_spec: CONV, mamba_utils.get_temporal_copy_spec: TEMPORAL}
    kinds = tuple(known.get(f) for f in copy_funcs)
    return None if None in kinds else kinds


def group_states(kv_cache_config, copy_funcs_by_type, forward_context) -> dict[int, list[tuple[object, str]]]:
    """{mamba group id: [(state tensor, kind), …]} over the group's layers. ValueError for a state this module cannot
    copy."""
    from vllm.v1.kv_cache_interface import MambaSpec
    from vllm.v1.worker import mamba_utils as worker_mamba

    out: dict[int, list[tuple[object, str]]] = {}
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        if not isinstance(group.kv_cache_spec, MambaSpec):
            continue
        states = out[gid] = []
        for layer in group.layer_names:
            spec = worker_mamba._get_mamba_spec_for_layer(group, layer)
            kinds = state_kinds(copy_funcs_by_type[spec.mamba_type])
            if kinds is None:
                raise ValueError(f"state copy functions of mamba type {spec.mamba_type!r} are not vLLM's conv/temporal")
            states += list(zip(forward_context[layer].kv_cache, kinds))
    return out


def apply_copies(states: dict[int, list[tuple[object, str]]], copies, dim_first: bool) -> int:
    """Run ``copies`` ``(group, conv_src, temporal_src, dst, b)`` on the state tensors (:func:`group_states`):
    ``temporal[dst] = temporal[temporal_src]``; conv (SD ``(blocks, len, dim)`` or DS ``(blocks, dim, len)``)
    ``conv[dst][:len - b] = conv[conv_src][b:]`` along the window. Batched per tensor (one indexed copy for the
    temporal state, one per distinct ``b`` for the conv state). Returns the number of copies run."""
    import torch

    by_group: dict[int, list] = {}
    for gid, conv_src, temporal_src, dst, bias in copies:
        by_group.setdefault(int(gid), []).append((int(conv_src), int(temporal_src), int(dst), int(bias)))
    n = 0
    for gid, rows in by_group.items():
        for state, kind in states.get(gid, ()):
            device = state.device
            if kind == TEMPORAL:
                src = torch.tensor([r[1] for r in rows], device=device)
                dst = torch.tensor([r[2] for r in rows], device=device)
                state[dst] = state[src]
                continue
            length = state.shape[2] if dim_first else state.shape[1]
            for bias in sorted({r[3] for r in rows}):
                sel = [r for r in rows if r[3] == bias]
                src = torch.tensor([r[0] for r in sel], device=device)
                dst = torch.tensor([r[2] for r in sel], device=device)
                if bias >= length:
                    continue
                if dim_first:
                    state[dst, :, :length - bias] = state[src, :, bias:]
                else:
                    state[dst, :length - bias] = state[src, bias:]
        n += len(rows)
    return n


def run(runner, copies) -> int:
    """Run one step's copies on ``runner``'s KV-cache tensors (their layout is resolved once per runner)."""
    states = getattr(runner, "_qwen_answer_states", None)
    if states is None:
        states = runner._qwen_answer_states = group_states(
            runner.kv_cache_config, runner._get_mamba_state_copy_funcs(),
            runner.compilation_config.static_forward_context)
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    return apply_copies(states, copies, is_conv_state_dim_first())


def copy_blocks(kv_caches, num_blocks: int, kv_cache_block_copies) -> None:
    """``copy_kv_cache_blocks_inplace`` copying, for each (device, address, scheduler-block stride) of the layer
    views, the widest span any of them uses in a block: views that share an address (layers packed into one tensor)
    are all copied, and a tensor's padding past every view is left alone."""
    import torch

    if not kv_cache_block_copies:
        return
    spans: dict[tuple, tuple[int, object]] = {}
    for cache in kv_caches:
        per_block, remainder = divmod(cache.shape[0], num_blocks)
        if remainder:
            raise AssertionError(f"{cache.shape[0]} kernel blocks not divisible by {num_blocks} scheduler blocks")
        size = cache.element_size()
        stride = cache.stride(0) * size * per_block  # bytes between scheduler blocks
        block = cache[:per_block]
        extent = (sum((n - 1) * st for n, st in zip(block.shape, block.stride())) + 1) * size
        if extent > stride:
            raise AssertionError(f"a block's view spans {extent} bytes, more than the {stride}-byte block stride")
        key = (cache.device, cache.data_ptr(), stride)
        if extent > spans.get(key, (0, None))[0]:
            spans[key] = (extent, cache)
    pairs = torch.tensor([tuple(c) for c in kv_cache_block_copies], dtype=torch.int64)
    indices: dict = {}
    for (device, ptr, stride), (extent, cache) in spans.items():
        if device not in indices:
            indices[device] = pairs.to(device, non_blocking=True).unbind(1)
        src, dst = indices[device]
        storage = cache.untyped_storage()
        raw = torch.empty(0, dtype=torch.uint8, device=device)
        raw.set_(storage)
        view = raw.as_strided((num_blocks, extent), (stride, 1), ptr - storage.data_ptr())
        view[dst] = view[src]


def active() -> bool:
    """Whether the runner in this process runs the copies (the engine core asks before it attaches any): the model
    runner module is loaded here and wrapped. A source-patched engine core whose workers run in other processes never
    loads it: answer checkpoints then stay off under speculative decoding."""
    runner = sys.modules.get(RUNNER)
    return bool(runner is not None and getattr(runner.GPUModelRunner, _MARK, False))


def install(settings) -> bool:
    """Replace the runner's block copy (``kv_block_copies``) and wrap ``GPUModelRunner._update_states`` for the
    answer-state copies (``kv_turn_checkpoints`` and ``kv_answer_checkpoints``); idempotent, the CPU runner inherits
    both. False when neither applies."""
    from vllm.v1.worker import gpu_model_runner

    fixed = bool(getattr(settings, "kv_block_copies", False))
    if fixed:
        gpu_model_runner.copy_kv_cache_blocks_inplace = copy_blocks
    if not (getattr(settings, "kv_turn_checkpoints", False) and getattr(settings, "kv_answer_checkpoints", False)):
        return fixed
    GPUModelRunner = gpu_model_runner.GPUModelRunner
    if getattr(GPUModelRunner, _MARK, False):
        return True
    update = GPUModelRunner._update_states

    @functools.wraps(update)
    def _update_states(self, scheduler_output):
        copies = getattr(scheduler_output, ATTR, None)
        if copies:  # first: vLLM's copies below may copy a destination on (a same-step hit)
            run(self, copies)
        return update(self, scheduler_output)

    GPUModelRunner._update_states = _update_states
    setattr(GPUModelRunner, _MARK, True)
    return True
