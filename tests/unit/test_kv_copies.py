"""The KV-cache copies the model runner runs for prefix caching: answer-state copies under speculative decoding
(issue 49 step 3) and vLLM's block copies with layers packed into one tensor.

The model runner's copies (``qwen_vllm_ext.kv.state_copies``) are compared byte for byte with vLLM's own reading of
a step's state columns: the fused precopy (its CPU implementation, checked against the Triton kernel's semantics in
``test_cpu_mamba_kernels``) copying column ``src`` to another column with ``token_bias`` b. The engine-core side
(``qwen_vllm_ext.kv.hybrid_checkpoints``) is exercised with vLLM's real block pool: which unit position a step keeps,
which columns and offset its copy reads, that a rejected draft leaves no key, and that held blocks go back."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from ..helpers.mamba_kernels import COPY_FUNCS, LAYERS, World, assert_same_bytes, ref_precopy, run_precopy  # noqa: E402

UNIT = 16


def _states(world: World):
    from qwen_vllm_ext.kv.state_copies import state_kinds

    out: dict[int, list] = {}
    for i, layer in enumerate(LAYERS):
        kinds = state_kinds(COPY_FUNCS[layer.mamba_type])
        out.setdefault(layer.group, []).extend(zip(world.states(i), kinds))
    return out


@pytest.mark.parametrize("dim_first", [False, True], ids=["SD", "DS"])
def test_copies_read_the_state_columns_as_vllms_precopy_does(dim_first, monkeypatch):
    """Each copy (group, conv source, temporal source, destination, b) writes exactly what vLLM's fused precopy
    writes for "column src -> column dst with token_bias b" (src and src + b being the two sources), in every layer
    and state tensor of the group, both conv layouts, and nothing else."""
    from qwen_vllm_ext.kv.state_copies import apply_copies

    rows = [(4, 1, 0), (5, 1, 2), (6, 0, 1), (7, 2, 3)]  # (destination column, source column, b) per request row
    reference = World(11, dim_first, monkeypatch)
    expected = reference.snapshot()
    ref_precopy(reference, expected, rows)
    run_precopy(reference, rows)  # vLLM's precopy (CPU implementation) agrees with the reading
    assert_same_bytes(reference, expected)

    world = World(11, dim_first, monkeypatch)
    before = world.snapshot()
    copies = []
    for r, (dst, src, b) in enumerate(rows):
        for g, table in enumerate(world.tables):
            bt = table[r].tolist()
            copies.append((g, bt[src], bt[src + b], bt[dst], b))
    assert apply_copies(_states(world), copies, dim_first) == len(copies)
    assert_same_bytes(world, expected, before)


def test_a_state_kind_it_cannot_copy_is_refused():
    from qwen_vllm_ext.kv.state_copies import CONV, TEMPORAL, state_kinds

    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_copy_spec, get_temporal_copy_spec

    assert state_kinds((get_conv_copy_spec, get_temporal_copy_spec)) == (CONV, TEMPORAL)
    assert state_kinds((get_temporal_copy_spec,)) == (TEMPORAL,)
    assert state_kinds((get_conv_copy_spec, lambda *a: None)) is None


# ----------------------------------------------------------------------------------------------------------------
# The engine-core side, with vLLM's real block pool

def _engine(spec: int = 2):
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(num_gpu_blocks=48, enable_caching=True, hash_block_size=UNIT)
    copies: list = []
    manager = SimpleNamespace(_qwen_answer_unit=UNIT, _qwen_spec=spec, block_size=64, block_pool=pool,
                              kv_cache_group_id=1, num_speculative_blocks=spec, req_to_blocks={},
                              _qwen_columns={}, _qwen_last_columns={}, _qwen_state_copies=copies)
    request = SimpleNamespace(request_id="r", num_prompt_tokens=70, num_computed_tokens=70,
                              block_hashes=[bytes([i]) * 8 for i in range(20)])
    return pool, manager, request


def _step(manager, request, computed: int, scheduled: int):
    """One scheduling step as vLLM runs it: the allocation (the running column and speculative blocks after it), then
    the cache hook (keep, then the step base)."""
    from qwen_vllm_ext.kv.hybrid_checkpoints import keep_answer_state, record_state_columns, step_scheduled

    request.num_computed_tokens = computed
    blocks = manager.req_to_blocks.setdefault(request.request_id, [])
    need = -(-(computed + scheduled) // manager.block_size) + manager.num_speculative_blocks
    blocks += manager.block_pool.get_new_blocks(need - len(blocks)) if need > len(blocks) else []
    record_state_columns(manager, request.request_id, computed + scheduled)
    key = keep_answer_state(manager, request)
    step_scheduled(manager, request)
    return key


def test_a_step_keeps_the_unit_its_accepted_tokens_crossed_from_the_right_column():
    from qwen_vllm_ext.kv.hybrid_checkpoints import take_state_copies

    pool, manager, request = _engine()
    cached = pool.cached_block_hash_to_block.get_one_block
    assert _step(manager, request, 70, 3) is None  # the first decode step after the prompt: no step before it
    # the step computed 70..72 (3 accepted): 70 + 3 = 73 crosses nothing
    assert _step(manager, request, 73, 3) is None and not manager._qwen_state_copies
    # steps from 73 (2 accepted) and 75 (3 accepted) reach 78: no multiple of 16 crossed
    assert _step(manager, request, 75, 3) is None
    assert _step(manager, request, 78, 3) is None
    columns = manager._qwen_columns["r"]  # the step from base 78: tokens 78, 79, 80 in columns 0, 1, 2
    key = _step(manager, request, 81, 3)  # all accepted: prefix 80 is the state after token 79 = column 1
    ((group, conv, temporal, dst, b),) = manager._qwen_state_copies
    assert (group, conv, temporal, b) == (1, columns[0], columns[1], 1) and cached(key) is dst
    assert all(blk.ref_cnt == 2 for blk in (conv, temporal)) and dst.ref_cnt == 1  # held for the step's copy
    copies, held = take_state_copies(SimpleNamespace(_qwen_state_copies=manager._qwen_state_copies))
    assert copies == [(1, conv.block_id, temporal.block_id, dst.block_id, 1)] and not manager._qwen_state_copies
    pool.free_blocks(held)  # what schedule() does once the output carries them
    assert conv.ref_cnt == temporal.ref_cnt == 1 and dst.ref_cnt == 0 and cached(key) is dst


def test_rejected_drafts_leave_no_state_and_no_key():
    """A step that verified 78, 79, 80 (a unit at 80) but accepted only the first token computes 79: no unit was
    computed, nothing is queued or registered; the next step that does reach 80 keeps it."""
    pool, manager, request = _engine()
    _step(manager, request, 75, 3)
    _step(manager, request, 78, 3)
    free = pool.get_num_free_blocks()
    assert _step(manager, request, 79, 3) is None
    assert not manager._qwen_state_copies and pool.get_num_free_blocks() == free
    assert not getattr(request, "_qwen_answer_states", {})
    assert _step(manager, request, 82, 3) is not None  # base 79: 79, 80, 81 accepted: 80 = column 0, b 0
    (_, conv, temporal, _, b), = manager._qwen_state_copies
    assert b == 0 and conv is temporal


def test_the_next_state_reuses_the_previous_block_and_a_finished_request_keeps_its_last_unit():
    from qwen_vllm_ext.kv.hybrid_checkpoints import keep_answer_state, take_state_copies

    pool, manager, request = _engine()
    cached = pool.cached_block_hash_to_block.get_one_block
    _step(manager, request, 75, 3)
    _step(manager, request, 78, 3)
    first = _step(manager, request, 81, 3)
    _, held = take_state_copies(SimpleNamespace(_qwen_state_copies=manager._qwen_state_copies))
    pool.free_blocks(held)
    first_block = cached(first)
    for computed in (84, 87, 90, 93):
        assert _step(manager, request, computed, 3) is None
    second = _step(manager, request, 96, 3)  # base 93: 93, 94, 95 -> 96 is column 2
    (_, _, _, dst, b), = manager._qwen_state_copies
    assert b == 2 and dst is first_block and cached(first) is None and cached(second) is dst
    _, held = take_state_copies(SimpleNamespace(_qwen_state_copies=manager._qwen_state_copies))
    pool.free_blocks(held)
    # the request's last step ran from 110 (tokens 110, 111, 112 in columns 0-2) and accepted all 3: prefix 112 is
    # the state after token 111, column 1; no later step sees it, so the free path keeps it
    for computed in (99, 102, 105, 108):
        _step(manager, request, computed, 3)
    _step(manager, request, 110, 3)
    columns = manager._qwen_columns["r"]
    request.num_computed_tokens = 113  # the last step's outcome; the request is freed now
    final = keep_answer_state(manager, request, finished=True)
    (_, conv, temporal, dst, b), = manager._qwen_state_copies
    assert b == 1 and conv is columns[0] and temporal is columns[1] and cached(final) is dst


def test_a_prefill_step_is_no_base_and_async_scheduling_turns_it_off():
    from qwen_vllm_ext.kv import hybrid_checkpoints as hc

    pool, manager, request = _engine()
    request.num_prompt_tokens = 90
    _step(manager, request, 64, 26)  # the prompt's last chunk: 64..89
    assert _step(manager, request, 91, 3) is None  # crossed 80 only inside the prompt: vLLM's checkpoints
    assert _step(manager, request, 94, 3) is None
    assert _step(manager, request, 97, 3) is not None  # 96 in the step from 94
    scheduler = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=True))
    assert "async scheduling" in hc.speculative_why_not(scheduler)


# ----------------------------------------------------------------------------------------------------------------
# vLLM's block copies with layers packed into one tensor (the MTP layout of a hybrid model)

def _packed_layout(num_blocks: int = 6, page: int = 64):
    """One raw buffer with two layer slots of ``num_blocks`` pages each, as vLLM lays out a KV-cache group of two
    layers: slot 0 holds a Gated DeltaNet state (an int8 view over the first 40 bytes of each page) and an attention
    layer (float16, the whole page) at the same address, slot 1 another attention layer."""
    import torch

    raw = torch.randint(0, 256, (2 * num_blocks * page,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    slot0, slot1 = raw[:num_blocks * page], raw[num_blocks * page:]
    gdn = slot0.view(num_blocks, page)[:, :40]
    attn0 = slot0.view(torch.float16).view(num_blocks, 2, page // 4)
    attn1 = slot1.view(torch.float16).view(num_blocks, 2, page // 4)
    return raw, [gdn, attn1, attn0], num_blocks, page  # vLLM's runner lists the first view at an address first


def test_block_copies_copy_every_layer_sharing_an_address():
    """vLLM's copy (the copy-on-write of a partial-block prefix hit) skips the attention view that starts where the
    GDN view does, leaving 24 of each 64-byte page uncopied; ``copy_blocks`` copies every byte any view uses, in
    both slots, and nothing outside the destination pages."""
    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
    from vllm.v1.worker.utils import copy_kv_cache_blocks_inplace

    from qwen_vllm_ext.kv.state_copies import copy_blocks

    copies = [KVCacheBlockCopy(src_block_id=1, dst_block_id=4), KVCacheBlockCopy(src_block_id=2, dst_block_id=5)]
    raw, views, n, page = _packed_layout()
    copy_kv_cache_blocks_inplace(views, n, copies)
    slot0 = raw[:n * page].view(n, page)
    assert bool((slot0[4, :40] == slot0[1, :40]).all()) and not bool((slot0[4, 40:] == slot0[1, 40:]).all())

    raw, views, n, page = _packed_layout()
    before = raw.clone()
    copy_blocks(views, n, copies)
    expected = before.clone().view(2, n, page)
    for c in copies:
        expected[:, c.dst_block_id] = before.view(2, n, page)[:, c.src_block_id]
    assert bool((raw.view(2, n, page) == expected).all())
    copy_blocks(views, n, [])  # nothing to copy: nothing written
    assert bool((raw.view(2, n, page) == expected).all())
