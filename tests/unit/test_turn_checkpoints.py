"""Turn checkpoints on hybrid models: where the next chat turn diverges (pure core), what a kept state costs, and
the glue's opener lookup on a real tokenizer."""
from __future__ import annotations

import pytest

from qwen_v3_calculator.chat import render_chat
from qwen_v3_calculator.tokenizer import Tokenizer
from qwen_vllm_ext.demo import HYBRID_CONFIG
from qwen_vllm_ext.kv.checkpoints import (MAX_GENERATION_TAIL, RUNNING_STATES, answer_repeated, copy_reserve,
                                          memory_plan, state_bytes, turn_boundary, weight_params)
from qwen_vllm_ext.kv.reuse import common_prefix

UNIT = 16


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.bundled("qwen3.6")


@pytest.fixture(scope="module")
def opener(tok):
    ids = tok.encode("<|im_start|>assistant\n")
    assert len(ids) == 3
    return ids


def _turns(n: int, answer: str, reasoning: str | None):
    """Message lists of n requests of one conversation; each answer fed back as content (+ reasoning_content)."""
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "question 0 " * 7}]
    out = [list(msgs)]
    for k in range(1, n):
        a = {"role": "assistant", "content": f"{answer} {k}"}
        if reasoning is not None:
            a["reasoning_content"] = f"{reasoning} {k}"
        msgs = msgs + [a, {"role": "user", "content": f"question {k} " * (3 + k)}]
        out.append(list(msgs))
    return out


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("reasoning", [None, "I think about it"])
def test_the_boundary_is_where_the_next_turn_diverges_under_the_official_template(tok, opener, thinking, reasoning):
    """Official Qwen3.5 template: the next request shares this prompt exactly up to the end of its last
    ``<|im_start|>assistant\\n`` — the earlier answer is re-rendered without the generation prompt's think block."""
    requests = _turns(6, "The answer is short and plain.", reasoning)
    prompts = [tok.encode(render_chat(m, template="qwen3.5", enable_thinking=thinking)) for m in requests]
    for prev, nxt in zip(prompts, prompts[1:]):
        shared = common_prefix(prev, nxt)
        assert prev[shared - 3:shared] == opener  # diverges right after the opener
        assert turn_boundary(prev, opener, UNIT) == shared // UNIT * UNIT
        assert turn_boundary(prev, opener, 1) == shared
        # vLLM's own prompt checkpoint sits at (prompt - 1) floored: past the shared part whenever the generation
        # prompt's 2 (thinking on) or 4 (off) tokens cross a unit boundary
        assert len(prev) - shared == (2 if thinking else 4)


def test_no_boundary_without_a_generation_prompt(tok, opener):
    msgs = _turns(2, "An answer.", None)[1]
    no_gen = tok.encode(render_chat(msgs, template="qwen3.5", add_generation_prompt=False))
    # the last opener is the history answer's, followed by far more than a generation prompt
    assert turn_boundary(no_gen, opener, UNIT) == 0
    prefilled = tok.encode(render_chat(msgs + [{"role": "assistant", "content": "Sure, here is a long prefilled "
                                                "start of the answer that goes on"}], template="qwen3.5",
                                       add_generation_prompt=False, continue_final_message=True))
    assert turn_boundary(prefilled, opener, UNIT) == 0
    assert turn_boundary(tok.encode("plain text, no chat at all"), opener, UNIT) == 0


def test_boundary_edges(opener):
    body = list(range(1000, 1029))  # 29 ordinary ids
    assert turn_boundary(body + opener + [7, 8], opener, UNIT) == 32  # 29 + 3 = 32
    assert turn_boundary(body[:-1] + opener + [7, 8], opener, UNIT) == 16  # 31 floors to 16
    assert turn_boundary(opener + [7], opener, UNIT) == 0  # floors to 0: nothing to keep
    tail = [5] * MAX_GENERATION_TAIL
    assert turn_boundary(body + opener + tail, opener, UNIT) == 32
    assert turn_boundary(body + opener + tail + [5], opener, UNIT) == 0  # too long a tail: not a generation prompt
    # the last opener wins
    assert turn_boundary(opener + body + opener + [7], opener, 1) == 3 + 29 + 3
    assert turn_boundary([], opener, UNIT) == 0 and turn_boundary(body, (), UNIT) == 0
    assert turn_boundary(body + opener, opener, 0) == 0


def test_state_bytes_match_what_vllm_allocated_for_the_demo():
    """vLLM 0.32 CPU on the demo logged "Setting attention block size to 640 tokens" and "Padding mamba page size by
    22.14%": a float32 recurrent state, bf16 conv state, 128-token alignment."""
    s = state_bytes(HYBRID_CONFIG, block_align=128)
    assert s["layers"] == 3 and s["attention_layers"] == 1 and s["block_size"] == 640
    per_layer = s["raw"] // 3
    assert per_layer == 3 * (2 * 128 + 2 * 128) * 2 + 2 * 128 * 128 * 4
    assert round(100 * (s["padded"] / s["raw"] - 1), 2) == 22.14
    # an explicit mamba_ssm_dtype and tensor parallelism change the state
    half = state_bytes({**HYBRID_CONFIG, "mamba_ssm_dtype": "bfloat16"}, block_align=128)
    assert half["raw"] < s["raw"]
    with pytest.raises(KeyError):
        state_bytes({"num_hidden_layers": 4})


def test_weight_params_equal_the_architectures_parameter_count():
    """The memory plan's weights: exactly the parameters of Transformers' own Qwen3-Next (the demo), Qwen3.5 dense
    (Qwen3.6-27B) and Qwen3.5 MoE (Qwen3.6-35B-A3B) language models, built on the meta device (no memory)."""
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForCausalLM
    from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextForCausalLM

    from benchmarks.hybrid_state_bytes import PUBLISHED

    cases = [(HYBRID_CONFIG, Qwen3NextConfig, Qwen3NextForCausalLM),
             (PUBLISHED["Qwen3.6-27B"], Qwen3_5TextConfig, Qwen3_5ForCausalLM),
             (PUBLISHED["Qwen3.6-35B-A3B"], Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM)]
    for config, config_cls, model_cls in cases:
        fields = {k: v for k, v in config.items() if k not in ("dtype", "torch_dtype", "architectures")}
        with torch.device("meta"):
            model = model_cls(config_cls(**fields))
        assert weight_params(config) == sum(p.numel() for p in model.parameters()), config_cls.__name__
    assert round(weight_params(PUBLISHED["Qwen3.6-27B"]) / 1e9, 1) == 26.9
    assert round(weight_params(PUBLISHED["Qwen3.6-35B-A3B"]) / 1e9, 1) == 34.7


def test_memory_plan_blocks_and_concurrency_match_what_vllm_logged_for_the_demo():
    """vLLM 0.32 CPU on the demo: 2 GiB of KV cache (VLLM_CPU_KVCACHE_SPACE) -> "num_gpu_blocks=13107"; with 400
    blocks, "Maximum concurrency for 16,384 tokens per request: 12.50x" (26 attention blocks + 2 states of 3 blocks
    per running request)."""
    demo = dict(utilization=1.0, reserve_bytes=0, weight_bytes_per_param=0, block_align=128, context_tokens=16384)
    assert memory_plan(HYBRID_CONFIG, 2 << 30, **demo)["blocks"] == 13107
    p = memory_plan(HYBRID_CONFIG, 400 * 640 * 256, concurrency=(12, 13, 64), **demo)
    assert p["blocks"] == 400 and p["state_blocks"] == 3 and p["attention_blocks"] == 26 and RUNNING_STATES == 2
    assert [r["running"] for r in p["rows"]] == [12, 12, 12] and [r["waiting"] for r in p["rows"]] == [0, 1, 52]


def test_copy_reserve_keeps_a_block_per_group_for_every_running_request():
    """Issue 48: an answer copy never takes a block a running request could need at its next step (each may cross
    a block boundary in every KV-cache group), and at least max(2, blocks / 32) stay free."""
    assert copy_reserve(80, 0, 4) == 2 and copy_reserve(80, 9, 4) == 36 and copy_reserve(3200, 1, 4) == 100
    assert copy_reserve(1568, 64, 4) == 256 and copy_reserve(0, 0, 4) == 2


def test_memory_plan_accounts_for_every_block_and_skips_answers_under_the_copy_guard():
    from benchmarks.hybrid_state_bytes import PUBLISHED

    cfg = PUBLISHED["Qwen3.6-27B"]
    s = state_bytes(cfg)
    for gib in (80, 141, 400):
        p = memory_plan(cfg, gib << 30, context_tokens=8192, concurrency=(1, 64, 256))
        per_running = p["attention_blocks"] + RUNNING_STATES * p["state_blocks"]
        kept = p["attention_blocks"] + p["state_blocks"]
        assert p["block_bytes"] * p["state_blocks"] == s["padded"] and p["block_tokens"] == s["block_size"] == 784
        for r in p["rows"]:
            free = p["blocks"] - r["running"] * per_running
            assert 0 <= r["answer_blocks"] <= r["running"] * p["state_blocks"]
            assert r["copy_guard"] == copy_reserve(p["blocks"], r["running"], 1 + p["state_blocks"])
            assert r["answer_blocks"] <= max(free - r["copy_guard"], 0)  # copies stop at the guard
            assert r["idle_kept"] * kept + r["answer_blocks"] <= free
            assert r["idle_kept"] <= r["idle_kept_without_answers"]
            assert r["running"] + r["waiting"] == r["concurrency"]
            assert r["copy_bytes_per_step"] == r["running"] / 16 * 2 * s["raw"]
            assert 0 <= r["copy_share"] < 0.05
    # a card the weights do not leave room on runs nothing and keeps nothing
    none = memory_plan(cfg, 40 << 30)
    assert none["blocks"] == 0 and all(r["running"] == 0 and r["idle_kept"] == 0 for r in none["rows"])


def test_opener_ids_come_from_the_served_tokenizer(qwen36_tokenizer_dir, opener):
    from transformers import AutoTokenizer

    from qwen_vllm_ext.kv.hybrid_checkpoints import opener_ids

    assert opener_ids(AutoTokenizer.from_pretrained(str(qwen36_tokenizer_dir))) == tuple(opener)
    assert opener_ids(None) is None  # --skip-tokenizer-init: no turn checkpoints


def test_the_boundary_is_dropped_where_the_prompt_checkpoint_covers_it(opener):
    """vLLM keeps a state at (prompt - 1) floored to the unit; a boundary at or past it adds nothing."""
    from types import SimpleNamespace

    from qwen_vllm_ext.kv.hybrid_checkpoints import _boundary

    kvm = SimpleNamespace(_qwen_turn_opener=tuple(opener), _qwen_turn_unit=UNIT)
    body = list(range(1000, 1029))
    ids = body + opener + [7, 8]          # boundary 32, prompt 34: vLLM's checkpoint at 32 already
    req = SimpleNamespace(prompt_token_ids=ids, num_prompt_tokens=len(ids))
    assert _boundary(kvm, req) == 0 and req._qwen_turn_boundary == 0
    ids = body + [9] * 10 + opener + [7, 8]  # boundary 32 (42 floored), vLLM's checkpoint at 32 too
    assert _boundary(kvm, SimpleNamespace(prompt_token_ids=ids, num_prompt_tokens=len(ids))) == 0
    ids = body[:-2] + opener + [7, 8, 9, 10]  # boundary 16 (30 floored); vLLM's at 32
    req = SimpleNamespace(prompt_token_ids=ids, num_prompt_tokens=len(ids))
    assert _boundary(kvm, req) == 16
    req.prompt_token_ids = []  # computed once per request
    assert _boundary(kvm, req) == 16


@pytest.mark.parametrize("tail, extra", [(2, 1), (4, 3)])
def test_an_extra_state_only_where_the_generation_prompt_crosses_a_unit(opener, tail, extra):
    """Thinking on (2 tokens after the opener) needs a state of its own in 1 prompt length of 16, thinking off (4
    tokens) in 3 of 16: elsewhere vLLM's prompt checkpoint is the turn boundary already (docs/kv-reuse.md)."""
    from types import SimpleNamespace

    from qwen_vllm_ext.kv.hybrid_checkpoints import _boundary

    kvm = SimpleNamespace(_qwen_turn_opener=tuple(opener), _qwen_turn_unit=UNIT)
    placed = 0
    for body in range(100, 100 + 4 * UNIT):
        ids = [1000] * body + opener + [7] * tail
        placed += _boundary(kvm, SimpleNamespace(prompt_token_ids=ids, num_prompt_tokens=len(ids))) > 0
    assert placed == 4 * extra


# ---- answer checkpoints -----------------------------------------------------------------------------------------
def test_answer_checkpoints_apply_only_with_the_prefix_stable_template():
    from types import SimpleNamespace

    from qwen_vllm_ext.demo import HYBRID_VARIANT, ensure_demo_model
    from qwen_vllm_ext.kv.hybrid_checkpoints import answer_checkpoints_apply

    on = SimpleNamespace(kv_answer_checkpoints=True, kv_reuse_template=True)
    hybrid = str(ensure_demo_model(variant=HYBRID_VARIANT))
    assert answer_checkpoints_apply(on, hybrid) is None
    assert answer_checkpoints_apply(on, "Qwen/Qwen3.6-35B-A3B") is None
    assert "kv_answer_checkpoints=false" in answer_checkpoints_apply(
        SimpleNamespace(kv_answer_checkpoints=False, kv_reuse_template=True), hybrid)
    # the official template re-renders answers: a decode state would never be hit
    assert "kv_reuse_template=false" in answer_checkpoints_apply(
        SimpleNamespace(kv_answer_checkpoints=True, kv_reuse_template=False), hybrid)
    assert "does not apply" in answer_checkpoints_apply(on, "Qwen/Qwen3-Next-80B-A3B-Instruct")


def _decoding(computed: int, prompt: int, known: int, blocks: int = 2, null: tuple = ()):
    """A fake manager (block 64, unit 16) and request: ``computed`` tokens computed, ``known`` tokens hashed."""
    from types import SimpleNamespace

    manager = SimpleNamespace(_qwen_answer_unit=UNIT, block_size=64,
                              req_to_blocks={"r": [SimpleNamespace(is_null=i in null) for i in range(blocks)]})
    request = SimpleNamespace(request_id="r", num_computed_tokens=computed, num_prompt_tokens=prompt,
                              block_hashes=[0] * (known // UNIT))
    return manager, request


def test_answer_position_is_a_decode_unit_inside_a_block_whose_hash_exists():
    from qwen_vllm_ext.kv.hybrid_checkpoints import _answer_position

    assert _answer_position(*_decoding(80, 70, 81)) == 80     # decoding, on a unit, inside block 1
    assert _answer_position(*_decoding(81, 70, 82)) == 0      # not on a unit
    assert _answer_position(*_decoding(64, 50, 65)) == 64     # a block's end: the state is in block 0
    assert _answer_position(*_decoding(64, 50, 65), block_ends=False) == 0  # attention: vLLM caches the full block
    assert _answer_position(*_decoding(48, 50, 49)) == 0      # still the prompt: vLLM's checkpoints
    assert _answer_position(*_decoding(80, 70, 79)) == 0      # async scheduling: the newest token not known yet
    assert _answer_position(*_decoding(80, 70, 81, null=(1,))) == 0
    assert _answer_position(*_decoding(144, 70, 145)) == 0    # no block there
    assert _answer_position(*_decoding(128, 70, 129, null=(1,))) == 0  # the state would be in block 1
    manager, request = _decoding(80, 70, 81)
    manager._qwen_answer_unit = 0                            # off for this engine
    assert _answer_position(manager, request) == 0


def test_keep_answer_state_copies_into_a_new_block_and_keeps_only_the_newest():
    """With vLLM's real block pool: the running state is queued for a copy into a fresh block registered under
    the prefix; the request's previous answer state leaves the cache once nobody holds it and its block takes the
    next copy; a short pool keeps nothing new (a request is never left short); a finished request's running block
    is registered as it is."""
    from types import SimpleNamespace

    from vllm.v1.core.block_pool import BlockPool

    from qwen_vllm_ext.kv.hybrid_checkpoints import keep_answer_state

    pool = BlockPool(num_gpu_blocks=40, enable_caching=True, hash_block_size=UNIT)
    cached = pool.cached_block_hash_to_block.get_one_block
    running = pool.get_new_blocks(2)
    manager = SimpleNamespace(_qwen_answer_unit=UNIT, block_size=64, block_pool=pool, kv_cache_group_id=0,
                              req_to_blocks={"r": running}, _pending_cow_copies=[])
    request = SimpleNamespace(request_id="r", num_prompt_tokens=70, num_computed_tokens=80,
                              block_hashes=[bytes([i]) * 8 for i in range(20)])
    key = keep_answer_state(manager, request)
    (source, first), = manager._pending_cow_copies
    assert source is running[1] and first not in running and first.block_hash == key
    assert cached(key) is first
    pool.free_blocks([source, first])  # what the scheduler does once the copy has run
    assert first.ref_cnt == 0 and cached(key) is first  # kept, evictable

    request.num_computed_tokens = 96
    free_before = pool.get_num_free_blocks()
    newer = keep_answer_state(manager, request)
    # the older state left the cache and its block takes the newer copy: no fresh block, so no LRU eviction of
    # other conversations' entries all through a long answer
    assert newer != key and cached(key) is None and cached(newer) is first and first.block_hash == newer
    assert manager._pending_cow_copies[-1] == (running[1], first) and first.ref_cnt == 1
    assert pool.get_num_free_blocks() == free_before - 1  # held until the copy has run
    pool.free_blocks([running[1], first])
    assert pool.get_num_free_blocks() == free_before and cached(newer) is first

    pool.get_new_blocks(pool.get_num_free_blocks() - 2)  # leave the pool short
    request._qwen_answer_states = {}  # (a request with no earlier answer state to reuse)
    request.num_computed_tokens = 112
    assert keep_answer_state(manager, request) is None and pool.get_num_free_blocks() == 2

    request.num_computed_tokens = 120  # not a unit: nothing at a step; finished on 112 -> the block itself
    assert keep_answer_state(manager, request, finished=True) is None
    request.num_computed_tokens = 112
    final = keep_answer_state(manager, request, finished=True)
    assert running[1].block_hash == final and len(manager._pending_cow_copies) == 2  # no copy for the final one


def _conversations(blocks: int):
    """vLLM's real block pool with two conversations' kept states, freed in LRU order: "other" (position 32), then
    ours at 32 (turn 1), 64 (prompt tail) and 96 (answer, the newest)."""
    from types import SimpleNamespace

    from vllm.v1.core.block_pool import BlockPool

    from qwen_vllm_ext.kv.hybrid_checkpoints import STATS

    pool = BlockPool(num_gpu_blocks=blocks, enable_caching=True, hash_block_size=UNIT)
    stats = dict.fromkeys(STATS, 0)
    manager = SimpleNamespace(block_pool=pool, kv_cache_group_id=0, shared_prefix_checkpoint=True,
                              _qwen_kv_stats=stats)
    attention = SimpleNamespace(block_pool=pool, kv_cache_group_id=1)  # not a Mamba manager: untouched
    kvm = SimpleNamespace(_qwen_turn_unit=UNIT, coordinator=SimpleNamespace(single_type_managers=[attention, manager]))
    ours = SimpleNamespace(request_id="a", block_hashes=[b"a%02d" % i for i in range(8)], num_computed_tokens=100)
    other = SimpleNamespace(request_id="b", block_hashes=[b"b%02d" % i for i in range(8)], num_computed_tokens=40)
    states = {}
    for name, request, position in (("other", other, 32), ("turn1", ours, 32), ("tail", ours, 64),
                                    ("answer", ours, 96)):
        block = pool.get_new_blocks(1)[0]
        states[name] = (block, pool.cache_partial_block(request=request, block=block, num_tokens=position,
                                                        kv_cache_group_id=0, block_size=64))
    pool.free_blocks([states[n][0] for n in ("other", "turn1", "tail", "answer")])  # LRU: newest at the tail
    return pool, kvm, stats, ours, other, states


def test_superseded_states_are_evicted_first_under_pressure():
    """Issue 48: when a request is freed on a pool under pressure (a cached block near the front of the free queue),
    the states kept on its prefix before its newest move ahead of every other cached entry: the next allocations
    evict them before another conversation's state or this one's newest."""
    from types import SimpleNamespace

    from qwen_vllm_ext.kv.hybrid_checkpoints import demote_superseded

    pool, kvm, stats, ours, other, states = _conversations(12)
    cached = pool.cached_block_hash_to_block.get_one_block
    held = pool.get_new_blocks(5)  # 2 fresh blocks left ahead of the cached ones: under pressure
    assert demote_superseded(kvm, ours) == 2 and stats["states_demoted"] == 2
    assert all(cached(states[n][1]) is states[n][0] for n in states)  # still reachable until evicted
    assert demote_superseded(kvm, other) == 0  # its only state is its newest
    taken = pool.get_new_blocks(4)  # the 2 fresh blocks, then the superseded states, nothing else
    assert {b.block_id for b in taken[2:]} == {states["turn1"][0].block_id, states["tail"][0].block_id}
    assert cached(states["turn1"][1]) is None and cached(states["tail"][1]) is None
    assert cached(states["answer"][1]) is states["answer"][0] and cached(states["other"][1]) is states["other"][0]
    running = SimpleNamespace(request_id="c", block_hashes=ours.block_hashes, num_computed_tokens=100)
    pool.touch([states["answer"][0]])  # a running request holds the newest: nothing to move, nothing fails
    assert demote_superseded(kvm, running) == 0 and len(held) == 5


def test_superseded_states_stay_reachable_while_the_pool_is_roomy():
    """With more never-used blocks in front than PRESSURE_WALK nothing moves (an edited history still falls back to
    the older states); they are remembered and placed once pressure builds."""
    from qwen_vllm_ext.kv.hybrid_checkpoints import PRESSURE_WALK, demote_superseded

    pool, kvm, stats, ours, _, states = _conversations(PRESSURE_WALK + 20)
    cached = pool.cached_block_hash_to_block.get_one_block
    assert demote_superseded(kvm, ours) == 0 and len(kvm._qwen_superseded) == 2
    pool.get_new_blocks(10)
    assert all(cached(states[n][1]) is states[n][0] for n in states)
    pool.get_new_blocks(pool.get_num_free_blocks() - 4 - 3)  # 3 fresh blocks left: pressure
    assert demote_superseded(kvm, ours) == 2 and stats["states_demoted"] == 2
    taken = pool.get_new_blocks(5)
    assert {b.block_id for b in taken[3:]} == {states["turn1"][0].block_id, states["tail"][0].block_id}


def test_answer_repeated_only_where_the_next_prompt_brings_the_generation_back(tok, opener):
    """Issue 48: answer states are kept (and older states superseded by them) only where the next turn's prompt
    repeats what the request generates under the default ``preserve_thinking: "answers"``: thinking off, or a client
    whose history keeps reasoning (``preserve_thinking: true``). A thinking-on generation is otherwise dropped next
    turn, so the next prompt diverges at the turn boundary."""
    think = (tok.encode("<think>")[0], tok.encode("</think>")[0], tuple(tok.encode("<think>\n\n</think>")[1:-1]))
    assert len(think[2]) >= 1

    def prompt(messages, thinking, preserve="answers"):
        return tok.encode(render_chat(messages, template="qwen3.5-reuse", enable_thinking=thinking,
                                      preserve_thinking=preserve))

    first = [{"role": "user", "content": "Plan the trip."}]
    history = first + [{"role": "assistant", "content": "Go north.", "reasoning_content": "Weigh the roads."},
                       {"role": "user", "content": "And then?"}]
    plain = first + [{"role": "assistant", "content": "Go north."}, {"role": "user", "content": "And then?"}]
    assert answer_repeated(prompt(first, False), opener, think)          # thinking off: the answer comes back
    assert not answer_repeated(prompt(first, True), opener, think)       # thinking on, no kept reasoning
    assert not answer_repeated(prompt(history, True), opener, think)     # "answers": the reasoning was dropped
    assert not answer_repeated(prompt(plain, True), opener, think)       # empty think blocks are not reasoning
    assert answer_repeated(prompt(history, True, True), opener, think)   # the client keeps reasoning
    assert answer_repeated(prompt(history, False), opener, think)
    assert answer_repeated(prompt(first, True), opener, None)            # no think tokens: as before
    assert answer_repeated(tok.encode("plain text, no chat"), opener, think)  # not a chat generation prompt


def test_with_the_eagle_drop_the_two_newest_states_stay():
    """Under MTP a hit recomputes its last unit, so the next turn resumes from the state a unit before the newest
    (the attention layers cached to the newest): both stay where LRU put them, only older ones are superseded."""
    from qwen_vllm_ext.kv.hybrid_checkpoints import demote_superseded

    pool, kvm, stats, ours, _, states = _conversations(12)
    kvm._qwen_drop = UNIT
    cached = pool.cached_block_hash_to_block.get_one_block
    pool.get_new_blocks(5)  # under pressure
    assert demote_superseded(kvm, ours) == 1 and stats["states_demoted"] == 1
    taken = pool.get_new_blocks(3)
    assert taken[2].block_id == states["turn1"][0].block_id and cached(states["turn1"][1]) is None
    assert cached(states["tail"][1]) is states["tail"][0] and cached(states["answer"][1]) is states["answer"][0]


@pytest.mark.parametrize("drop", [0, UNIT])
def test_the_prompt_tail_is_where_vllm_keeps_the_prompts_state(drop):
    """``_prompt_tail`` (the turn boundary is dropped where it lies past it) is vLLM's own prefill checkpoint
    position, with and without the EAGLE drop; the junction sits the drop before the boundary."""
    from types import SimpleNamespace

    from vllm.v1.kv_cache_interface import get_mamba_prefill_checkpoint_position

    from qwen_vllm_ext.kv.hybrid_checkpoints import _boundary, _prompt_tail

    kvm = SimpleNamespace(_qwen_turn_unit=UNIT, _qwen_drop=drop, _qwen_turn_opener=(7, 8, 9))
    for n in range(1, 200):
        request = SimpleNamespace(num_prompt_tokens=n)
        assert _prompt_tail(kvm, request) == get_mamba_prefill_checkpoint_position(n, UNIT, bool(drop)), n
    # a generation prompt that crosses a unit: the boundary (48) lies before the prompt's own state
    prompt = [1] * 54 + [7, 8, 9] + [1] * 8
    request = SimpleNamespace(prompt_token_ids=prompt, num_prompt_tokens=len(prompt))
    assert _boundary(kvm, request) == 48 and _prompt_tail(kvm, request) == (48 if drop else 64)
    short = SimpleNamespace(prompt_token_ids=prompt[:60], num_prompt_tokens=60)  # the tail state covers it
    assert _boundary(kvm, short) == 0
