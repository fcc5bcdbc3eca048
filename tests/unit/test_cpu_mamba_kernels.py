"""CPU implementations of vLLM's fused mamba spec-decode kernels (qwen_vllm_ext.spec.cpu_mamba_kernels), compared
byte for byte with a pure-PyTorch reading of the Triton kernels on real state tensors, laid out and described by the
real ``MambaSpecDecodeGPUContext`` (vLLM CPU build; the harness: tests/helpers/mamba_kernels.py)."""
from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.worker import mamba_utils  # noqa: E402

from qwen_vllm_ext.spec import cpu_mamba_kernels as cmk  # noqa: E402

from ..helpers.mamba_kernels import (BLOCK_SIZE, LAYERS, MAX_COLS, MAX_REQS, World, as_int,  # noqa: E402
                                     assert_same_bytes, i32, ref_postprocess, ref_precopy, run_postprocess,
                                     run_precopy)


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
