"""The harness of the fused mamba spec-decode kernels' tests (qwen_vllm_ext.spec.cpu_mamba_kernels): real state
tensors laid out as vLLM's KV cache lays them out and described by a real ``MambaSpecDecodeGPUContext`` (``World``),
a pure-PyTorch reading of the Triton kernels (``ref_*``), and the CPU implementations run with the arguments the
runner's launches pass (``run_*``). Needs vLLM (CPU build): import it after ``pytest.importorskip("vllm")``."""
from __future__ import annotations

import dataclasses
import types

import torch
from vllm.model_executor.layers.mamba.mamba_utils import get_conv_copy_spec, get_temporal_copy_spec
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec
from vllm.v1.utils import CpuGpuBuffer
from vllm.v1.worker import mamba_utils

from qwen_vllm_ext.spec import cpu_mamba_kernels as cmk

BLOCK_SIZE = 4
MAX_REQS = 8
MAX_COLS = 8
NUM_BLOCKS = MAX_REQS * MAX_COLS + 5
GDN = MambaAttentionBackendEnum.GDN_ATTN
LINEAR = MambaAttentionBackendEnum.LINEAR
COPY_FUNCS = {GDN: (get_conv_copy_spec, get_temporal_copy_spec), LINEAR: (get_temporal_copy_spec,)}
INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# ----------------------------------------------------------------------------------------------------------------
# The world: per layer one raw page buffer holding the layer's states at padded page strides (as vLLM's KV cache
# reshape does), per mamba group one persistent int32 block table; described by a real MambaSpecDecodeGPUContext.

@dataclasses.dataclass
class Layer:
    group: int
    mamba_type: MambaAttentionBackendEnum
    conv_shape: tuple | None  # per block: SD (width, dim), DS (dim, width); None: temporal state only
    conv_dtype: torch.dtype | None
    ssm_shape: tuple
    ssm_dtype: torch.dtype


LAYERS = [  # three mamba groups: two GDN groups (conv + temporal), one linear-attention group (temporal only)
    Layer(0, GDN, (3, 16), torch.float16, (2, 4, 4), torch.float32),
    Layer(0, GDN, (3, 16), torch.float16, (2, 4, 4), torch.float32),
    Layer(1, GDN, (3, 8), torch.bfloat16, (1, 4, 8), torch.float16),
    Layer(2, LINEAR, None, None, (2, 8), torch.float32),
]


def page_bytes(layer: Layer) -> tuple[int, int]:
    """(offset of the temporal state in the page, page size): 8-byte aligned, with padding after each state."""
    conv = 0
    if layer.conv_shape is not None:  # room for the DS rows padded by one element
        width, dim = layer.conv_shape
        conv = dim * (width + 1) * layer.conv_dtype.itemsize
    ssm_off = -(-(conv + 8) // 8) * 8 if conv else 0
    ssm = torch.Size(layer.ssm_shape).numel() * layer.ssm_dtype.itemsize
    return ssm_off, -(-(ssm_off + ssm + 24) // 8) * 8


def contiguous_strides(shape):
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def state_views(layer: Layer, raw: torch.Tensor, dim_first: bool) -> list[torch.Tensor]:
    ssm_off, page = page_bytes(layer)
    views = []
    if layer.conv_shape is not None:
        esz = layer.conv_dtype.itemsize
        if dim_first:  # DS: (dim, width), rows padded by one element (row stride != width)
            dim, width = layer.conv_shape[1], layer.conv_shape[0]
            shape, inner = (dim, width), (width + 1, 1)
        else:
            shape, inner = layer.conv_shape, contiguous_strides(layer.conv_shape)
        views.append(torch.as_strided(raw.view(layer.conv_dtype), (NUM_BLOCKS, *shape), (page // esz, *inner), 0))
    esz = layer.ssm_dtype.itemsize
    views.append(torch.as_strided(raw.view(layer.ssm_dtype), (NUM_BLOCKS, *layer.ssm_shape),
                                  (page // esz, *contiguous_strides(layer.ssm_shape)), ssm_off // esz))
    return views


def kv_cache_config(dim_first: bool) -> KVCacheConfig:
    groups = []
    for g in sorted({la.group for la in LAYERS}):
        layers = [(i, la) for i, la in enumerate(LAYERS) if la.group == g]
        la = layers[0][1]
        shapes = ((la.conv_shape[::-1] if dim_first else la.conv_shape,) if la.conv_shape else ()) + (la.ssm_shape,)
        dtypes = ((la.conv_dtype,) if la.conv_shape else ()) + (la.ssm_dtype,)
        spec = MambaSpec(block_size=BLOCK_SIZE, shapes=shapes, dtypes=dtypes, page_size_padded=page_bytes(la)[1],
                         mamba_type=la.mamba_type, mamba_cache_mode="align", num_speculative_blocks=2)
        groups.append(KVCacheGroupSpec([f"layers.{i}.mixer" for i, _ in layers], spec))
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)


class World:
    """Raw state memory + block tables; ``ctx`` (a real MambaSpecDecodeGPUContext) points at them."""

    def __init__(self, seed: int, dim_first: bool = False, monkeypatch=None):
        gen = torch.Generator().manual_seed(seed)
        self.dim_first = dim_first
        self.raws = [torch.randint(0, 256, (NUM_BLOCKS * page_bytes(la)[1],), dtype=torch.uint8, generator=gen)
                     for la in LAYERS]
        self.num_groups = len({la.group for la in LAYERS})
        # distinct physical blocks for every (request, column) of a group
        self.tables = [torch.randperm(NUM_BLOCKS, generator=gen)[:MAX_REQS * MAX_COLS].to(torch.int32)
                       .view(MAX_REQS, MAX_COLS).clone() for _ in range(self.num_groups)]
        config = kv_cache_config(dim_first)
        self.ctx = mamba_utils.MambaSpecDecodeGPUContext.create(
            max_num_reqs=MAX_REQS, kv_cache_config=config, copy_funcs=COPY_FUNCS, device=torch.device("cpu"),
            make_buffer=lambda *size, dtype: CpuGpuBuffer(*size, dtype=dtype, device=torch.device("cpu"),
                                                          pin_memory=False))
        forward_context = {f"layers.{i}.mixer": types.SimpleNamespace(kv_cache=self.states(i))
                           for i in range(len(LAYERS))}
        if monkeypatch is not None:
            monkeypatch.setattr(mamba_utils, "is_conv_state_dim_first", lambda: dim_first)
        else:
            assert not dim_first
        self.ctx.initialize_from_forward_context(config, forward_context, COPY_FUNCS,
                                                 [self.tables[g] for g in self.ctx.mamba_group_ids])

    def states(self, i: int, raws=None) -> list[torch.Tensor]:
        return state_views(LAYERS[i], (raws or self.raws)[i], self.dim_first)

    def snapshot(self) -> list[torch.Tensor]:
        return [r.clone() for r in self.raws]

    def meta_args(self) -> list:
        c = self.ctx
        return [c.block_table_ptrs, c.block_table_stride_req, c.state_base_addrs, c.state_block_strides,
                c.state_elem_sizes, c.state_inner_sizes, c.state_conv_widths, c.state_group_indices,
                c.state_dim_row_count, c.state_dim_row_stride]


# ----------------------------------------------------------------------------------------------------------------
# Reference reading of the Triton kernels, in tensor-indexing terms, on a copy of the raw memory.

def as_int(t: torch.Tensor) -> torch.Tensor:
    """The same elements reinterpreted as integers (bit-exact copies, NaN payloads included)."""
    return t.view(INT_OF_SIZE[t.element_size()])


def ref_copy(world: World, raws, r: int, src: int, dst: int, bias: int) -> None:
    """_copy_mamba_state_block for request row r, every layer and state tensor:
    conv SD   state[bt[dst], :W-bias]    = state[bt[src], bias:]     (W = conv width; nothing when bias >= W)
    conv DS   state[bt[dst], :, :W-bias] = state[bt[src], :, bias:]
    temporal  state[bt[dst]]             = state[bt[src + bias]]
    where bt = block_tables[group of the layer][r]; every source is read before the destination is written."""
    for i, layer in enumerate(LAYERS):
        bt = world.tables[layer.group][r].tolist()
        views = [as_int(v) for v in world.states(i, raws)]
        if layer.conv_shape is not None:
            conv = views.pop(0)
            width = conv.shape[2] if world.dim_first else conv.shape[1]
            n = max(width - bias, 0)
            if n:
                if world.dim_first:
                    conv[bt[dst], :, :n] = conv[bt[src], :, bias:bias + n].clone()
                else:
                    conv[bt[dst], :n] = conv[bt[src], bias:bias + n].clone()
        (ssm,) = views
        ssm[bt[dst]] = ssm[bt[src + bias]].clone()


def ref_postprocess(world: World, raws, rows, block_size=BLOCK_SIZE, precomputed=False, idx_mapping=None):
    """postprocess_mamba_fused_kernel. rows[r] = (computed, scheduled, draft, accepted, state_idx) (precomputed:
    computed is the post-step count and scheduled/draft are unused); batch row i is request slot idx_mapping[i]
    (skipped when < 0), or slot i. Returns num_accepted_tokens_out (pre-filled with the accepted counts).
    running = computed + scheduled - draft, new = running + accepted - 1 (precomputed: new = computed,
    running = new - accepted + 1); aligned = new // block_size * block_size; when aligned >= running:
    dst = aligned // block_size - 1, bias = aligned - running; if state_idx == dst: out = 1 and, with bias 0,
    no copy; else copy column state_idx -> dst shifted by bias. out keeps the accepted count otherwise."""
    out = [row[3] for row in rows]
    slots = range(len(rows)) if idx_mapping is None else [s for s in idx_mapping if s >= 0]
    for r in slots:
        computed, scheduled, draft, accepted, src = rows[r]
        if precomputed:
            new = computed
            running = new - accepted + 1
        else:
            running = computed + scheduled - draft
            new = running + accepted - 1
        aligned = new // block_size * block_size
        if aligned < running:
            continue
        dst, bias = aligned // block_size - 1, aligned - running
        if src == dst:
            out[r] = 1
            if bias == 0:
                continue
        ref_copy(world, raws, r, src, dst, bias)
    return out


def ref_precopy(world: World, raws, rows, idx_mapping=None):
    """precopy_mamba_align_fused_kernel. rows[slot] = (state_idx, src_col, token_bias); batch row i is slot
    idx_mapping[i] (skipped when < 0), or slot i. A slot with src_col >= 0 and src_col != state_idx copies column
    src_col -> state_idx shifted by token_bias; nothing else is written."""
    slots = range(len(rows)) if idx_mapping is None else [s for s in idx_mapping if s >= 0]
    for s in slots:
        dst, src, bias = rows[s]
        if src >= 0 and src != dst:
            ref_copy(world, raws, s, src, dst, bias)


# ----------------------------------------------------------------------------------------------------------------
# Running the CPU implementations with the arguments the runner's launches pass.

def i32(values, size=MAX_REQS):
    t = torch.zeros(size, dtype=torch.int32)
    t[:len(values)] = torch.tensor(values, dtype=torch.int32)
    return t


def run_postprocess(world: World, rows, precomputed=False, idx_mapping=None, accepted_dtype=torch.int32):
    computed, scheduled, draft, accepted, state_idx = (list(col) for col in zip(*rows))
    accepted_t = i32(accepted).to(accepted_dtype)
    out = i32(accepted)  # the runner pre-fills the output with the inputs
    cmk.postprocess_mamba_fused_kernel_cpu(
        accepted_t, i32(state_idx), None if precomputed else i32(scheduled), i32(computed),
        None if precomputed else i32(draft), *world.meta_args(), out,
        None if idx_mapping is None else i32(idx_mapping, len(idx_mapping)),
        len(rows) if idx_mapping is None else len(idx_mapping),
        block_size=world.ctx.block_size, COPY_BLOCK_SIZE=1024, CONV_STATE_DIM_FIRST=world.dim_first,
        HAS_IDX_MAPPING=idx_mapping is not None, PRECOMPUTED_NEW_COMPUTED=precomputed, TEMPORAL_TILES=16)
    return out[:len(rows)].tolist()


def run_precopy(world: World, rows, idx_mapping=None):
    state_idx, src_col, bias = (list(col) for col in zip(*rows))
    n = len(rows) if idx_mapping is None else len(idx_mapping)
    cmk.precopy_mamba_align_fused_kernel_cpu(
        i32(state_idx), i32(src_col), i32(bias), *world.meta_args(),
        None if idx_mapping is None else i32(idx_mapping, n), n,
        COPY_BLOCK_SIZE=1024, CONV_STATE_DIM_FIRST=world.dim_first, HAS_IDX_MAPPING=idx_mapping is not None,
        TEMPORAL_TILES=16)


def assert_same_bytes(world: World, expected_raws, before=None, must_change=True):
    for i, (got, want) in enumerate(zip(world.raws, expected_raws)):
        assert torch.equal(got, want), f"layer {i}: {(got != want).sum().item()} bytes differ from the reference"
    if before is not None and must_change:
        assert any(not torch.equal(a, b) for a, b in zip(world.raws, before)), "nothing was copied"
