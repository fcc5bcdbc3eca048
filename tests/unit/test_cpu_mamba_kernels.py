"""CPU implementations of vLLM's fused mamba spec-decode kernels (qwen_vllm_ext.spec.cpu_mamba_kernels), compared
byte for byte with a pure-PyTorch reading of the Triton kernels on real state tensors, laid out and described by the
real ``MambaSpecDecodeGPUContext`` (vLLM CPU build)."""
from __future__ import annotations

import dataclasses
import random
import types

import pytest
import torch

pytest.importorskip("vllm")

from vllm.model_executor.layers.mamba.mamba_utils import get_conv_copy_spec, get_temporal_copy_spec  # noqa: E402
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec  # noqa: E402
from vllm.v1.utils import CpuGpuBuffer  # noqa: E402
from vllm.v1.worker import mamba_utils  # noqa: E402

from qwen_vllm_ext.spec import cpu_mamba_kernels as cmk  # noqa: E402

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


# (computed, scheduled, draft, accepted, state_idx) with block_size 4, conv width 3
POSTPROCESS_ROWS = [
    (4, 3, 2, 2, 1),  # running 5, new 6, aligned 4 < 5: no copy
    (5, 3, 2, 3, 1),  # running 6, new 8: dst 1 == src, bias 2: out 1, same-block shift
    (7, 3, 2, 1, 2),  # running 8, new 8: dst 1 != src 2, bias 0
    (6, 3, 2, 2, 2),  # running 7, new 8: dst 1 != src 2, bias 1
    (7, 3, 2, 1, 1),  # running 8: dst 1 == src, bias 0: out 1, no copy
    (4, 4, 3, 4, 0),  # running 5, new 8: dst 1, src 0, bias 3 == conv width: temporal copy only
    (0, 10, 0, 1, 2),  # prefill: running 10, aligned 8 < 10: no copy
]


@pytest.mark.parametrize("dim_first", [False, True], ids=["SD", "DS"])
def test_postprocess_matches_the_reference(dim_first, monkeypatch):
    world = World(1, dim_first, monkeypatch)
    assert world.ctx.num_states == 7 and world.ctx.num_groups == 3
    before = world.snapshot()
    expected = world.snapshot()
    want_out = ref_postprocess(world, expected, POSTPROCESS_ROWS)
    assert want_out == [2, 1, 1, 2, 1, 4, 1]
    got_out = run_postprocess(world, POSTPROCESS_ROWS)
    assert got_out == want_out
    assert_same_bytes(world, expected, before)


def test_postprocess_precomputed_with_idx_mapping(monkeypatch):
    """V2 flavour: the post-step computed count is given and batch rows map to request slots (-1: skipped)."""
    world = World(2)
    # (new_computed, -, -, accepted, state_idx) per request slot
    rows = [(8, 0, 0, 3, 1), (8, 0, 0, 2, 2), (9, 0, 0, 1, 1), (9, 0, 0, 2, 1), (8, 0, 0, 4, 0)]
    mapping = [4, -1, 0, 1, 2]  # slot 3 is not in the batch
    expected = world.snapshot()
    want = ref_postprocess(world, expected, rows, precomputed=True, idx_mapping=mapping)
    assert want == [1, 2, 1, 2, 4]  # slot 3 (src == dst: would be reset to 1) is not in the batch
    got = run_postprocess(world, rows, precomputed=True, idx_mapping=mapping)
    assert got == want
    assert_same_bytes(world, expected)


def test_postprocess_random(monkeypatch):
    rng = random.Random(7)
    for seed in range(4):
        world = World(100 + seed, dim_first=bool(seed % 2), monkeypatch=monkeypatch)
        rows = []
        for _ in range(MAX_REQS):
            draft = rng.randint(0, 3)
            scheduled = draft + 1 if rng.random() < 0.8 else rng.randint(draft + 1, 9)
            computed = rng.randint(0, 16)
            accepted = rng.randint(1, draft + 1)
            new = computed + scheduled - draft + accepted - 1
            dst = max(new // BLOCK_SIZE - 1, 0)
            state_idx = rng.choice([dst, dst, max(dst - 1, 0), dst + 1]) if rng.random() < 0.9 else rng.randint(0, 3)
            rows.append((computed, scheduled, draft, accepted, min(state_idx, MAX_COLS - 5)))
        expected = world.snapshot()
        want = ref_postprocess(world, expected, rows)
        assert run_postprocess(world, rows, accepted_dtype=torch.int64) == want
        assert_same_bytes(world, expected)


# (state_idx = dst column, src_col, token_bias)
PRECOPY_ROWS = [
    (0, -1, 0),  # fresh request: nothing
    (2, 2, 1),  # same column: nothing, whatever the bias
    (2, 1, 0),  # next block, bias 0
    (3, 1, 2),  # bias 2: conv window shifted, temporal from column 3
    (3, 2, 3),  # bias 3 == conv width: temporal only (column 5 -> 3)
    (1, 0, 1),
]


@pytest.mark.parametrize("dim_first", [False, True], ids=["SD", "DS"])
def test_precopy_matches_the_reference(dim_first, monkeypatch):
    world = World(3, dim_first, monkeypatch)
    before = world.snapshot()
    expected = world.snapshot()
    ref_precopy(world, expected, PRECOPY_ROWS)
    run_precopy(world, PRECOPY_ROWS)
    assert_same_bytes(world, expected, before)
    for i in (0, 1):  # rows 0 and 1 touched nothing: their destination blocks kept their bytes
        for layer_i in range(len(LAYERS)):
            for view_now, view_before in zip(world.states(layer_i), world.states(layer_i, before)):
                bt = world.tables[LAYERS[layer_i].group][i]
                blk = int(bt[PRECOPY_ROWS[i][0]])
                assert torch.equal(as_int(view_now[blk]), as_int(view_before[blk]))


@pytest.mark.parametrize("dim_first", [False, True], ids=["SD", "DS"])
def test_precopy_overlapping_same_block_shift(dim_first, monkeypatch):
    """Two columns that name one physical block: the conv window slides left inside the block (memmove)."""
    world = World(4, dim_first, monkeypatch)
    for table in world.tables:
        table[5, 2] = table[5, 1]
    rows = [(0, -1, 0)] * 5 + [(2, 1, 1)]
    before = world.snapshot()
    expected = world.snapshot()
    ref_precopy(world, expected, rows)
    run_precopy(world, rows)
    assert_same_bytes(world, expected, before)


def test_precopy_with_idx_mapping():
    world = World(5)
    mapping = [3, -1, 0, 5, 2]
    expected = world.snapshot()
    ref_precopy(world, expected, PRECOPY_ROWS, idx_mapping=mapping)
    run_precopy(world, PRECOPY_ROWS, idx_mapping=mapping)
    assert_same_bytes(world, expected)


def test_nothing_to_do_writes_nothing():
    world = World(6)
    before = world.snapshot()
    run_precopy(world, [(1, -1, 0), (2, 2, 2)])
    assert run_postprocess(world, [(4, 3, 2, 2, 1), (0, 1, 0, 1, 0)]) == [2, 1]  # (0,1,0,1,0): aligned 0 < 1
    assert_same_bytes(world, before)


def test_negative_token_bias_is_refused():
    world = World(8)
    with pytest.raises(ValueError, match="negative token bias"):
        run_precopy(world, [(2, 1, -1)])


# ----------------------------------------------------------------------------------------------------------------
# Registration: vLLM's own launch sites (MambaSpecDecodeGPUContext.run_fused_*) work on this CPU build.

@pytest.fixture
def registered(monkeypatch):
    from vllm.triton_utils import dispatcher

    monkeypatch.setattr(dispatcher, "_registry", dict(dispatcher._registry))
    for name in cmk.KERNELS:
        attr = name.rsplit(".", 1)[1]
        monkeypatch.setattr(mamba_utils, attr, getattr(mamba_utils, attr))  # restored after the test
    return cmk.register()


def test_register_is_a_no_op_with_triton(monkeypatch):
    import vllm.triton_utils

    monkeypatch.setattr(vllm.triton_utils, "HAS_TRITON", True)
    before = mamba_utils.postprocess_mamba_fused_kernel
    assert cmk.register() == []
    assert mamba_utils.postprocess_mamba_fused_kernel is before


def test_registered_kernels_run_through_the_runner_context(registered, monkeypatch):
    from vllm.triton_utils import HAS_TRITON
    from vllm.triton_utils.dispatcher import KernelOverride

    assert not HAS_TRITON
    assert registered == ["vllm.v1.worker.mamba_utils.postprocess_mamba_fused_kernel",
                          "vllm.v1.worker.mamba_utils.precopy_mamba_align_fused_kernel"]
    assert isinstance(mamba_utils.postprocess_mamba_fused_kernel, KernelOverride)
    assert isinstance(mamba_utils.precopy_mamba_align_fused_kernel, KernelOverride)
    assert cmk.register() == registered  # idempotent: still the same wrappers
    assert mamba_utils.precopy_mamba_align_fused_kernel.func is cmk.precopy_mamba_align_fused_kernel_cpu

    for dim_first in (False, True):
        world = World(9 + dim_first, dim_first, monkeypatch)
        ctx = world.ctx
        # preprocess_mamba -> run_fused_precopy (V1: no idx mapping)
        n = len(PRECOPY_ROWS)
        for buf, col in zip((ctx.mamba_state_idx_buf, ctx.precopy_src_col_buf, ctx.precopy_token_bias_buf),
                            zip(*PRECOPY_ROWS)):
            buf.np[:n] = col
            buf.copy_to_gpu(n)
        before = world.snapshot()
        expected = world.snapshot()
        ref_precopy(world, expected, PRECOPY_ROWS)
        ctx.run_fused_precopy(num_reqs=n, state_idx_gpu=ctx.mamba_state_idx_buf.gpu,
                              src_col_gpu=ctx.precopy_src_col_buf.gpu,
                              token_bias_gpu=ctx.precopy_token_bias_buf.gpu, idx_mapping=None)
        assert_same_bytes(world, expected, before)

        # postprocess_mamba_align_gpu -> run_fused_postprocess
        rows = POSTPROCESS_ROWS
        n = len(rows)
        computed, scheduled, draft, accepted, state_idx = zip(*rows)
        for buf, col in ((ctx.mamba_state_idx_buf, state_idx), (ctx.num_scheduled_tokens_buf, scheduled),
                         (ctx.num_computed_tokens_buf, computed), (ctx.num_draft_tokens_buf, draft)):
            buf.np[:n] = col
            buf.copy_to_gpu(n)
        accepted_gpu = torch.zeros(MAX_REQS, dtype=torch.int32)
        accepted_gpu[:n] = torch.tensor(accepted)
        expected = world.snapshot()
        want = ref_postprocess(world, expected, rows)
        ctx.run_fused_postprocess(num_reqs=n, num_accepted_tokens_gpu=accepted_gpu,
                                  mamba_state_idx_gpu=ctx.mamba_state_idx_buf.gpu,
                                  num_scheduled_tokens_gpu=ctx.num_scheduled_tokens_buf.gpu,
                                  num_computed_tokens_gpu=ctx.num_computed_tokens_buf.gpu,
                                  num_draft_tokens_gpu=ctx.num_draft_tokens_buf.gpu)
        assert ctx.num_accepted_tokens_out[:n].tolist() == want
        assert accepted_gpu[:n].tolist() == list(accepted)  # the input is left alone
        assert_same_bytes(world, expected)


def test_registered_kernel_accepts_a_keyword_launch(registered):
    """The warmup machinery launches kernels as kernel[grid](**kwargs) keyed by the kernel's argument names."""
    world = World(11)
    rows = PRECOPY_ROWS
    state_idx, src_col, bias = zip(*rows)
    names = mamba_utils.precopy_mamba_align_fused_kernel.arg_names
    values = [i32(state_idx), i32(src_col), i32(bias), *world.meta_args(), None, len(rows), 1024, False, False, 16]
    expected = world.snapshot()
    ref_precopy(world, expected, rows)
    mamba_utils.precopy_mamba_align_fused_kernel[(len(rows), world.ctx.num_states, 16)](**dict(zip(names, values)))
    assert_same_bytes(world, expected)
