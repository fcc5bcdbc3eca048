"""vLLM glue (engine-core process): turn checkpoints on hybrid models — the only module of this capability that
touches vLLM's KV-cache manager (``vllm/v1/core``).

On a hybrid model (Gated DeltaNet + attention, prefix caching in ``align`` mode with a match unit finer than the
block) each chat request gets one extra kept state: where the next turn's prompt will diverge from this one
(:func:`.checkpoints.turn_boundary`, just after the last ``<|im_start|>assistant\\n``). The next turn then resumes
there instead of falling back to an older checkpoint. The mechanism is vLLM's own shared-prefix junction
(``request.shared_prefix_boundary``): the scheduler ends a prefill chunk at the junction and the Mamba manager
keeps the state there (copy-on-write when it lies inside a block). Upstream enables it only for EAGLE siblings;
here it is enabled for every align-mode hybrid engine and the junction is set to the turn boundary.

**Answer checkpoints** (``kv_answer_checkpoints``, with the prefix-stable ``qwen3.5-reuse`` template, which renders
the history exactly as generated): while a request decodes, each time its computed length reaches a multiple of
the match unit the running state is copied into a block keyed by that prefix — the copy runs on the worker
before the step's forward overwrites the state, through vLLM's own copy-on-write queue — and the request's previous
such state is dropped from the cache when nobody holds it, its block taking the copy (a fresh block per copy would
evict other conversations' entries all through a long answer), so one decode state per request is kept; the attention layers get a partial-block entry at the same length. The next turn then resumes at the end
of the previous answer (floored to the unit) instead of its prompt. A position is kept only when the hash of the
tokens it covers exists: always with synchronous scheduling; with async scheduling a position whose newest token
is still a placeholder is skipped. A finished request's last state (the steps never see it) is registered on its
running block as it is freed.

**One live state per conversation** (issue 48): when a request is freed, the states kept on its prefix before its
newest one -- the conversation's earlier answer states, its prompt-tail and turn-boundary states -- are superseded:
the conversation's next turn resumes from the newest. Under cache pressure those nobody holds move ahead of every
other cached entry in the free queue (:func:`demote_superseded`, :func:`place_superseded`), so they are evicted before
any other conversation's entries; while the pool is roomy they stay where LRU put them, reachable (an edited history
still falls back to them). Counters (answer-state copies made, copies
skipped because free blocks ran low, states demoted) are published once a second for ``/metrics``
(``kv-<pid>.json``, :mod:`qwen_vllm_ext.kv.metrics`).

Hooks (applied idempotently by the general plugin when ``kv_turn_checkpoints`` is on):

* ``Scheduler.__init__``        -> turns the junction checkpoint on in the scheduler and the Mamba managers when
  the engine qualifies (align mode, fine-grained hits, no MTP re-prefill tail, a tokenizer to find the opener),
  and the answer checkpoints when the served model gets the ``qwen3.5-reuse`` template (under speculative decoding:
  with synchronous scheduling and the model runner's state copies);
* ``KVCacheManager.get_computed_blocks`` -> returns the turn boundary as the junction when it lies beyond the hit
  and before the prompt's own tail checkpoint (else vLLM's junction, unchanged);
* ``FullAttentionManager._cache_partial_tail_block`` -> also registers the attention layers' partial block entry
  at the turn boundary (vLLM registers only the prompt tail), so attention can hit there too, and at the answer
  checkpoint (before vLLM's tail entry: a longer entry drops the block's shorter ones, re-added after it);
* ``MambaManager._cache_partial_tail_block`` -> keeps the answer checkpoint's state (copy-on-write into a new block);
* ``KVCacheManager.free`` -> keeps the state after a finished request's last forward when it ends on a unit (no
  later step sees that position), registered on the running blocks as they are freed;
* ``MambaManager.allocate_new_blocks`` -> under speculative decoding, records the step's state columns;
* ``Scheduler.schedule`` -> attaches the step's speculative-decoding state copies to its output.

**Speculative decoding (MTP, issue 49).** A verify step computes several tokens, so the unit positions fall inside a
step, and their states are in the step's state columns (the recurrent state after each verified token in its own
column, one convolution window read at an offset). Once the step's accepted tokens are known (the next scheduling
step), a unit the accepted tokens crossed is kept by an offset copy of those columns that the model runner runs
before anything else in the next step (:mod:`.state_copies`); a rejected draft never reaches the computed length, so
it leaves nothing. vLLM recomputes the last unit of every hit under EAGLE/MTP (its drafter needs the target's hidden
states there), so a state at ``L`` serves where the attention layers are cached to ``L + unit``: the two newest answer
states are kept per request, and the turn junction sits one unit before the turn boundary (attention entry at it).

Targets the behaviour depends on without wrapping them are fingerprinted as well (the scheduler's chunk split at
the junction, the Mamba manager's cache_blocks deferring same-step hits on the returned key, the KV-cache manager's
copy-on-write queue).
"""
from __future__ import annotations

import collections
import functools
import logging
import math
import os
import time

from .checkpoints import answer_repeated, copy_reserve, turn_boundary

# a child of vLLM's logger: the engine core configures only "vllm" (its handler and level), so INFO lines of a
# logger outside it never reach the log
logger = logging.getLogger("vllm.qwen_vllm_ext.kv")

_MARK = "_qwen_vllm_ext_turn_checkpoints"
OPENER_TEXT = "<|im_start|>assistant\n"
NOT_HYBRID = "no linear-attention (Mamba-type) layers"

# Compatibility guard (qwen_vllm_ext.integration.guard): wrapped or relied-on targets -> fingerprint per vLLM version.
# Regenerate with `python -m qwen_vllm_ext.patches fingerprints` after checking the code against a new vLLM (0.33.0
# checked by hand against the wheel's sources: get_computed_blocks gains an optional max_cache_hit_length, the
# checkpoint helpers gain a hash lookahead; the junction logic is unchanged).
PATCH_TARGETS = {
    "vllm.v1.core.sched.scheduler:Scheduler.__init__":
        {"0.32.0": "5b2bca265b251788", "0.33.0": "429b036a1bf6b158"},
    "vllm.v1.core.sched.scheduler:Scheduler._mamba_block_aligned_split":
        {"0.32.0": "3fed017193dfee3c", "0.33.0": "f3405419e904a2f8"},
    "vllm.v1.core.kv_cache_manager:KVCacheManager.get_computed_blocks":
        {"0.32.0": "e83147f5ea111ea0", "0.33.0": "11b9eece955b29b4"},
    "vllm.v1.core.single_type_kv_cache_manager:FullAttentionManager._cache_partial_tail_block":
        {"0.32.0": "99e4068434a3b29a", "0.33.0": "775d5ea5d98d0573"},
    "vllm.v1.core.single_type_kv_cache_manager:MambaManager._cache_partial_tail_block":
        {"0.32.0": "cfe3bbd4c5f09179", "0.33.0": "22ccf5a4cae17b40"},
    "vllm.v1.core.single_type_kv_cache_manager:MambaManager.cache_blocks":
        {"0.32.0": "52179d435613314c", "0.33.0": "52179d435613314c"},
    "vllm.v1.core.kv_cache_manager:KVCacheManager.free":
        {"0.32.0": "978a8e2a69ef730c", "0.33.0": "978a8e2a69ef730c"},
    "vllm.v1.core.kv_cache_manager:KVCacheManager.take_kv_cache_block_copies":
        {"0.32.0": "d64431229f1b8ab6", "0.33.0": "d64431229f1b8ab6"},
    # speculative decoding: the state columns of a step (allocation), the step's output carrying the state copies
    "vllm.v1.core.single_type_kv_cache_manager:MambaManager.allocate_new_blocks":
        {"0.32.0": "0a8d1acfc3605960", "0.33.0": "0a8d1acfc3605960"},
    # the EAGLE/MTP drop the junction and the kept answer states allow for (a hit recomputes its last unit; the
    # prompt's own state a unit before its floor)
    "vllm.v1.core.kv_cache_coordinator:HybridKVCacheCoordinator.find_longest_cache_hit":
        {"0.32.0": "ca610b0f5b303d3f", "0.33.0": "ca610b0f5b303d3f"},
    "vllm.v1.kv_cache_interface:get_mamba_prefill_checkpoint_position":  # 0.33: a hash lookahead, not under EAGLE
        {"0.32.0": "1b0ac208fb72781a", "0.33.0": "3dbf83434123da38"},
    "vllm.v1.core.sched.scheduler:Scheduler.schedule":
        {"0.32.0": "0afd4b561401cafb", "0.33.0": "8976aeb2f6ca1604"},
}


def opener_ids(tokenizer) -> tuple[int, ...] | None:
    """Ids of ``<|im_start|>assistant\\n`` in the served tokenizer (None: no ChatML opener)."""
    if tokenizer is None:
        return None
    try:
        ids = tokenizer.encode(OPENER_TEXT, add_special_tokens=False)
        special = tokenizer.convert_tokens_to_ids("<|im_start|>")
    except Exception:  # noqa: BLE001 - an unusual tokenizer: no turn checkpoints
        return None
    if not ids or ids[0] != special:
        return None
    return tuple(int(i) for i in ids)


def think_ids(tokenizer) -> tuple[int, int, tuple[int, ...]] | None:
    """(``<think>`` id, ``</think>`` id, the ids between them in an empty block ``<think>\\n\\n</think>``) of the
    served tokenizer; None when it has no think tokens (every generation is then taken to come back)."""
    try:
        ids = tokenizer.encode("<think>\n\n</think>", add_special_tokens=False)
        open_id, close_id = tokenizer.convert_tokens_to_ids("<think>"), tokenizer.convert_tokens_to_ids("</think>")
    except Exception:  # noqa: BLE001 - an unusual tokenizer: no think-aware answer states
        return None
    if len(ids) < 2 or ids[0] != open_id or ids[-1] != close_id:
        return None
    return int(open_id), int(close_id), tuple(int(i) for i in ids[1:-1])


def _repeated(holder, request) -> bool:
    """:func:`.checkpoints.answer_repeated` for ``request`` (computed once per request), with the opener and think
    ids ``holder`` (the KV-cache manager or one of its single-type managers) carries."""
    keep = getattr(request, "_qwen_answer_repeated", None)
    if keep is None:
        opener = getattr(holder, "_qwen_opener", None) or getattr(holder, "_qwen_turn_opener", None) or ()
        prompt = getattr(request, "prompt_token_ids", None) or ()
        keep = request._qwen_answer_repeated = answer_repeated(prompt, opener, getattr(holder, "_qwen_think", None))
    return keep


def answer_checkpoints_apply(settings, model: str, need_answer_checkpoints: bool = True) -> str | None:
    """None when answer checkpoints apply to the served ``model``, else why not. They pay off only where the next
    prompt repeats the answer token for token: the package's ``qwen3.5-reuse`` template, which the API server serves
    for the same models (``kv_reuse_template``; a user's own ``--chat-template`` is not visible to the engine).
    ``need_answer_checkpoints=False``: whether that template is served, whatever ``kv_answer_checkpoints`` says."""
    from .reuse import HYBRID_REUSE_TEMPLATE, reuse_template_for

    if need_answer_checkpoints and not getattr(settings, "kv_answer_checkpoints", False):
        return "kv_answer_checkpoints=false"
    if not getattr(settings, "kv_reuse_template", False):
        return "kv_reuse_template=false (the official template re-renders answers)"
    name, reason = reuse_template_for(model)
    if name != HYBRID_REUSE_TEMPLATE:
        return f"the {HYBRID_REUSE_TEMPLATE} template does not apply ({reason})"
    return None


def enable(scheduler, settings=None) -> str | None:
    """Turn the junction checkpoint on for ``scheduler``'s engine and give its KV-cache manager the opener ids
    (and, when :func:`answer_checkpoints_apply`, the answer checkpoints' unit to its Mamba and attention managers).
    Returns None when enabled, else why not (logged)."""
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, MambaManager

    kvm = scheduler.kv_cache_manager
    managers = [m for m in kvm.coordinator.single_type_managers if isinstance(m, MambaManager)]
    if not managers:
        return NOT_HYBRID
    if not getattr(scheduler, "mamba_partial_cache_hit", False):
        return "prefix caching is not in align mode with a match unit finer than the block (--prefix-match-unit)"
    if kvm.coordinator.num_reprefillable_tokens:
        return "multi-token-prediction re-prefill tail"
    try:
        from vllm.tokenizers.registry import cached_tokenizer_from_config

        opener = opener_ids(cached_tokenizer_from_config(scheduler.vllm_config.model_config))
    except Exception as exc:  # noqa: BLE001 - no tokenizer here: vLLM's checkpoints only
        logger.warning("qwen-vllm-ext: turn checkpoints off, the tokenizer did not load: %s", exc)
        opener = None
    if opener is None:
        return "the tokenizer has no <|im_start|>assistant opener (not a ChatML chat model)"
    kvm.mamba_shared_prefix_checkpoint = True
    for manager in managers:
        manager.shared_prefix_checkpoint = True
    scheduler.mamba_shared_prefix_checkpoint = True
    kvm._qwen_turn_opener = opener
    kvm._qwen_turn_unit = scheduler.hash_block_size
    # speculative decoding with a drafter that reads the target's hidden states (EAGLE, MTP): a hit recomputes its
    # last unit (vLLM's EAGLE drop), so a state at L serves only where the attention layers are cached to L + unit
    kvm._qwen_drop = scheduler.hash_block_size if kvm.coordinator.eagle_group_ids else 0
    for manager in kvm.coordinator.single_type_managers:
        manager._qwen_drop = kvm._qwen_drop
    try:
        think = think_ids(cached_tokenizer_from_config(scheduler.vllm_config.model_config))
    except Exception:  # noqa: BLE001 - the tokenizer loaded above; a failure here only drops the think check
        think = None
    kvm._qwen_think = think
    # whether the served template repeats a generation in the next prompt (qwen3.5-reuse): else the next turn
    # diverges at the turn boundary whatever was generated
    kvm._qwen_repeats = answer_checkpoints_apply(settings, scheduler.vllm_config.model_config.model,
                                                 need_answer_checkpoints=False) is None
    stats = dict.fromkeys(STATS, 0)  # one dict per engine, shared by its managers
    for manager in managers:
        manager._qwen_kv_stats = stats
    why_not = answer_checkpoints_apply(settings, scheduler.vllm_config.model_config.model)
    spec = max(m.num_speculative_blocks for m in managers)
    if why_not is None and spec:
        why_not = speculative_why_not(scheduler)
    kvm._qwen_answer_why_not = why_not
    if why_not is None:
        copies = kvm._qwen_state_copies = []  # this step's speculative-decoding state copies (schedule() drains)
        for manager in kvm.coordinator.single_type_managers:
            manager._qwen_groups = len(kvm.coordinator.single_type_managers)  # KV-cache groups sharing the pool
            manager._qwen_opener, manager._qwen_think = opener, think
            if isinstance(manager, (MambaManager, FullAttentionManager)):
                manager._qwen_answer_unit = scheduler.hash_block_size
                manager._qwen_spec = spec
                manager._qwen_keep = 2 if kvm._qwen_drop else 1  # answer states kept per request
                manager._qwen_state_copies = copies
                manager._qwen_columns, manager._qwen_last_columns = {}, {}
    return None


def speculative_why_not(scheduler) -> str | None:
    """None when answer checkpoints work under ``scheduler``'s speculative decoding, else why not. A step verifies
    several tokens, so the unit positions fall inside a step; the state there is one of the step's per-token state
    columns, copied with an offset by the model runner (:mod:`.state_copies`) once the step's accepted tokens are
    known: that needs synchronous scheduling and the copies installed in this process."""
    from . import state_copies

    if getattr(scheduler.scheduler_config, "async_scheduling", False):
        return ("speculative decoding with async scheduling (a step's accepted tokens are not known when the next "
                "step is scheduled)")
    if not state_copies.active():
        return "speculative decoding without the model runner's state copies (runtime patch kv_copies)"
    if getattr(scheduler, "defer_block_free", False):
        # a KV connector loading into freed blocks while another batch is in flight: the copies' blocks are released
        # as soon as the step's output is built, which only a step-synchronous engine allows
        return "speculative decoding with overlapping batches and a KV-consumer connector"
    return None


def _answer_position(manager, request, block_ends: bool = True, need_block: bool = True) -> int:
    """The prefix length to keep as this step's answer checkpoint, 0 for none: the request is decoding, its
    computed length is a multiple of the unit, and the hash of those tokens exists (with async scheduling the newest
    token may still be a placeholder). The state (KV) there is in block ``(c - 1) // block_size``. ``block_ends``:
    also at a block's end (the Mamba state: vLLM keeps decode states only under dense retention; the attention
    layers' full block is cached by vLLM anyway)."""
    unit = getattr(manager, "_qwen_answer_unit", 0)
    c = request.num_computed_tokens
    if unit and getattr(manager, "_qwen_spec", 0):
        c = _spec_position(manager, request, unit)
        if not c:
            return 0
    if (not unit or c <= request.num_prompt_tokens or c % unit or (c % manager.block_size == 0 and not block_ends)
            or len(request.block_hashes) < c // unit or not _repeated(manager, request)):
        return 0
    if not need_block:  # the state comes from the step's state columns (speculative decoding)
        return c
    blocks = manager.req_to_blocks[request.request_id]
    idx = (c - 1) // manager.block_size
    if idx >= len(blocks) or blocks[idx].is_null:
        return 0
    return c


def _spec_position(manager, request, unit: int) -> int:
    """Under speculative decoding: the newest unit position the request's last step computed (the step verified
    several tokens; its accepted ones end at the computed length), 0 for none or when that step was not a decode
    step (a prefill chunk keeps only its final state)."""
    base = getattr(request, "_qwen_step_base", {}).get(manager.kv_cache_group_id)
    c = request.num_computed_tokens
    u = c // unit * unit
    if base is None or base < request.num_prompt_tokens or not base < u <= c:
        return 0
    return u


def step_scheduled(manager, request) -> None:
    """After this step's hooks: the computed length the step starts from (the next step's base)."""
    bases = getattr(request, "_qwen_step_base", None)
    if bases is None:
        bases = request._qwen_step_base = {}
    bases[manager.kv_cache_group_id] = request.num_computed_tokens


def record_state_columns(manager, request_id: str, num_tokens_main_model: int) -> None:
    """Mamba manager, right after a step's allocation: the request's state columns this step (``col`` = the block
    the runner keeps the running state in, ``cdiv(computed + scheduled, block) - 1``, and the speculative blocks
    after it), kept as blocks: the next step's allocation may move them in the block table."""
    blocks = manager.req_to_blocks.get(request_id)
    col = -(-num_tokens_main_model // manager.block_size) - 1
    if not blocks or col < 0:
        return
    previous = manager._qwen_columns.pop(request_id, None)
    if previous is not None:
        manager._qwen_last_columns[request_id] = previous
    manager._qwen_columns[request_id] = blocks[col:col + 1 + manager.num_speculative_blocks]


def keep_spec_answer_state(manager, request, finished: bool = False):
    """Mamba manager under speculative decoding: the state at the answer checkpoint ``u`` (a unit position inside
    the request's last step) is that step's token ``b = u - base - 1``: its temporal state in state column ``b``, its
    convolution window in column 0 shifted by ``b``. Queue that copy (run by the model runner before this step's
    forward, :mod:`.state_copies`) into the block of the request's oldest kept answer state (dropped from the cache
    when nobody holds it) or a new one, registered under the prefix ``u``. With vLLM's EAGLE drop (MTP) the two newest
    states are kept: a turn that repeats the answer hits the one a unit before its end, the attention layers being
    cached to the end. Only accepted tokens reach the computed length, so a rejected
    draft never leaves a state or a key. ``finished``: the request is being freed after its last step. Returns the
    new key (None: nothing kept)."""
    u = _answer_position(manager, request, need_block=False)
    if not u:
        return None
    columns = (manager._qwen_columns if finished else manager._qwen_last_columns).get(request.request_id)
    base = request._qwen_step_base[manager.kv_cache_group_id]
    b = u - base - 1
    if not columns or b >= len(columns) or any(blk.is_null for blk in (columns[0], columns[b])):
        return None
    pool = manager.block_pool
    kept = getattr(request, "_qwen_answer_states", None)
    if kept is None:
        kept = request._qwen_answer_states = {}
    if pool.get_num_free_blocks() <= copy_reserve(
            pool.num_gpu_blocks, len(manager.req_to_blocks), getattr(manager, "_qwen_groups", 1)):
        count(manager, "answer_copies_skipped")
        return None
    states = kept.setdefault(manager.kv_cache_group_id, [])  # oldest first
    oldest = states.pop(0) if len(states) >= getattr(manager, "_qwen_keep", 1) else None
    target = _held_block(pool, _superseded_block(pool, oldest))
    key = pool.cache_partial_block(request=request, block=target, num_tokens=u,
                                   kv_cache_group_id=manager.kv_cache_group_id, block_size=manager.block_size)
    if key is None:
        pool.free_blocks([target])
        return None
    for blk in (columns[0], columns[b]):  # held until the step that runs the copy is scheduled
        blk.ref_cnt += 1
    manager._qwen_state_copies.append((manager.kv_cache_group_id, columns[0], columns[b], target, b))
    count(manager, "answer_copies")
    states.append((target, key))
    return key


def _superseded_block(pool, kept):
    """The block of a request's superseded answer state ``kept`` ((block, key) or None), dropped from the cache when
    nobody holds it and it still carries that key; None otherwise (it stays as it is)."""
    if kept is None:
        return None
    block, key = kept
    if block.ref_cnt == 0 and block.block_hash == key:
        pool._maybe_evict_cached_block(block)
        return block
    return None


def _held_block(pool, reuse):
    """A block for the next answer-state copy, held (ref 1): ``reuse`` taken out of the free queue, else a fresh one."""
    if reuse is None:
        return pool.get_new_blocks(1)[0]
    pool.touch([reuse])
    return reuse


def take_state_copies(kvm) -> tuple[list[tuple[int, int, int, int, int]], list]:
    """Drain the queued speculative-decoding state copies: ``(group, conv source, temporal source, destination, b)``
    block ids for the step's output, and the blocks held for them (released once the output is built: the step runs
    the copies before anything else can take those blocks)."""
    pending = getattr(kvm, "_qwen_state_copies", None)
    if not pending:
        return [], []
    copies = [(g, s0.block_id, sb.block_id, dst.block_id, b) for g, s0, sb, dst, b in pending]
    held = [blk for _, s0, sb, dst, _ in pending for blk in (s0, sb, dst)]
    pending.clear()
    return copies, held


def forget_state_columns(kvm, request) -> None:
    """A request's blocks are freed (finished or preempted): its recorded state columns and step bases are stale."""
    request._qwen_step_base = {}
    for manager in kvm.coordinator.single_type_managers:
        for attr in ("_qwen_columns", "_qwen_last_columns"):
            table = getattr(manager, attr, None)
            if table is not None:
                table.pop(request.request_id, None)


def keep_answer_state(manager, request, finished: bool = False):
    """Mamba manager: copy the running state at the answer checkpoint into a block registered under that prefix
    (vLLM's copy-on-write queue runs the copy before this step's forward): the request's previous answer block,
    dropped from the cache when nobody holds it, else a new one. ``finished``: the request is being freed, its
    running block holds the state after its last forward and is registered as it is (no copy). Returns the new key
    (None: nothing kept). Under speculative decoding: :func:`keep_spec_answer_state`."""
    if getattr(manager, "_qwen_spec", 0):
        return keep_spec_answer_state(manager, request, finished)
    c = _answer_position(manager, request)
    if not c:
        return None
    pool = manager.block_pool
    source = manager.req_to_blocks[request.request_id][(c - 1) // manager.block_size]
    kept = getattr(request, "_qwen_answer_states", None)
    if kept is None:
        kept = request._qwen_answer_states = {}
    previous = kept.get(manager.kv_cache_group_id)
    if not finished and pool.get_num_free_blocks() <= copy_reserve(
            pool.num_gpu_blocks, len(manager.req_to_blocks), getattr(manager, "_qwen_groups", 1)):
        # a copy takes a free block (a fresh one, or the previous state's, which sits in the free queue) outside the
        # step's allocation: never while a running request could need it (issue 48: no extra preemptions)
        count(manager, "answer_copies_skipped")
        return None
    # the request's previous answer state is superseded: drop it from the cache when nobody holds it, and copy the
    # new one into its block -- taking a fresh block every 16 tokens would evict the LRU cache's oldest entries
    # (other conversations' prefixes) all through a long answer
    reuse = _superseded_block(pool, previous)
    if finished:
        key = pool.cache_partial_block(request=request, block=source, num_tokens=c,
                                       kv_cache_group_id=manager.kv_cache_group_id, block_size=manager.block_size)
        kept_block = source
    else:
        kept_block = _held_block(pool, reuse)
        key = pool.cache_partial_block(request=request, block=kept_block, num_tokens=c,
                                       kv_cache_group_id=manager.kv_cache_group_id, block_size=manager.block_size)
        if key is None:
            pool.free_blocks([kept_block])
            return None
        # both ends stay held until the worker has run the copy (then the scheduler frees them: the copy stays
        # cached)
        manager._pending_cow_copies.append((source, kept_block))
        source.ref_cnt += 1
        count(manager, "answer_copies")
    if key is None:
        return None
    kept[manager.kv_cache_group_id] = (kept_block, key)
    return key


STATS = ("answer_copies", "answer_copies_skipped", "states_demoted")
PUBLISH_EVERY_S = 1.0


def count(manager, name: str, n: int = 1) -> None:
    """Add to this engine's counter ``name`` (:data:`STATS`); published at most once a second."""
    stats = getattr(manager, "_qwen_kv_stats", None)
    if stats is None:
        return
    stats[name] += n
    now = time.monotonic()
    if now - stats.get("_published", -math.inf) >= PUBLISH_EVERY_S:
        stats["_published"] = now
        from ..observability import status

        try:
            status.write_json(f"kv-{os.getpid()}.json", {"pid": os.getpid(), "stats": {
                k: v for k, v in stats.items() if not k.startswith("_")}})
        except OSError as exc:  # metrics only: never fail the engine for them
            logger.debug("qwen-vllm-ext: kv stats not published: %s", exc)


PRESSURE_WALK = 64
"""Free blocks looked at from the front of the free queue for the first cached one (:func:`place_superseded`)."""
MAX_PENDING = 4096
"""Superseded states remembered while the pool is roomy (the oldest are forgotten first)."""


def demote_superseded(kvm, request) -> int:
    """After ``request`` is freed: in each Mamba group with turn checkpoints, the newest state kept on its prefix
    stays where LRU put it; every older one nobody holds (the conversation's earlier answer states, its prompt-tail
    and turn-boundary states) is superseded and queued for :func:`place_superseded`. Returns how many were placed."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    unit = getattr(kvm, "_qwen_turn_unit", 0)
    hashes = request.block_hashes
    if not unit or not hashes:
        return 0
    last = min(len(hashes), request.num_computed_tokens // unit)
    if not (getattr(kvm, "_qwen_repeats", True) and _repeated(kvm, request)):
        # the next prompt does not repeat this generation (the official template; thinking on with the reasoning
        # dropped): the next turn resumes at the turn boundary, or at the prompt's own tail state when that lies
        # before it; the states past it are not superseded by it
        b = _boundary(kvm, request)
        b = b - getattr(kvm, "_qwen_drop", 0) if b else _prompt_tail(kvm, request)
        last = min(last, b // unit)
    pending = getattr(kvm, "_qwen_superseded", None)
    if pending is None:
        pending = kvm._qwen_superseded = collections.deque(maxlen=MAX_PENDING)
    # with the EAGLE drop a repeated answer resumes from the state a unit before the newest (the attention layers
    # cached to the newest): both stay
    keep = 2 if getattr(kvm, "_qwen_drop", 0) and last == min(len(hashes), request.num_computed_tokens // unit) else 1
    pool = counted = None
    for manager in kvm.coordinator.single_type_managers:
        if not getattr(manager, "shared_prefix_checkpoint", False):  # the Mamba managers enable() turned on
            continue
        pool, group, counted = manager.block_pool, manager.kv_cache_group_id, manager
        seen = 0
        for k in range(last, 0, -1):  # newest first: the first state found is the one the next turn resumes from
            block = pool.cached_block_hash_to_block.get_one_block(make_block_hash_with_group_id(hashes[k - 1], group))
            if block is None:
                continue
            if seen >= keep and block.ref_cnt == 0 and not block.is_null:
                pending.append((block, block.block_hash))
            seen += 1
    if pool is None:
        return 0
    return place_superseded(pool, pending, counted)


def _first_cached(queue):
    """The first cached block among the first PRESSURE_WALK free blocks, else the block where the walk stopped (an
    uncached block or the queue's tail), and whether it is cached."""
    node, walked, tail = queue.fake_free_list_head.next_free_block, 0, queue.fake_free_list_tail
    while node is not tail and node.block_hash is None and walked < PRESSURE_WALK:
        node, walked = node.next_free_block, walked + 1
    return node, node is not tail and node.block_hash is not None


def place_superseded(pool, pending, manager=None) -> int:
    """Under cache pressure, move the superseded states still cached and free to just before the first cached block
    of the free queue: the next allocations evict them ahead of every other conversation's entry, and after the
    never-used blocks in front. "Pressure": a cached block within the first PRESSURE_WALK free blocks. While the
    pool is roomier the states stay where they are and reachable (an edited history still falls back to them), and
    ``pending`` remembers them for later. Returns how many moved."""
    queue = pool.free_block_queue
    if not pending or not _first_cached(queue)[1]:
        return 0  # roomy: no cached entry is near the front, so none is evicted soon
    seen, moving = set(), []
    while pending:
        block, key = pending.popleft()
        if block.ref_cnt == 0 and block.block_hash == key and not block.is_null and block.block_id not in seen:
            seen.add(block.block_id)
            moving.append(block)
    for block in moving:
        queue.remove(block)
    anchor, _ = _first_cached(queue)  # ahead of every cached block (the walk passed only uncached ones)
    before = anchor.prev_free_block
    for block in moving:  # link them in between ``before`` and ``anchor``
        before.next_free_block, block.prev_free_block = block, before
        before = block
    before.next_free_block, anchor.prev_free_block = anchor, before
    queue.num_free_blocks += len(moving)
    if moving and manager is not None:
        count(manager, "states_demoted", len(moving))
    return len(moving)


def keep_final_state(kvm, request) -> None:
    """A request is being freed: the state after its last forward (the prompt and all but the last generated token)
    is in its running blocks; keep it when it ends on a unit (the steps only saw the positions before it)."""
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    for manager in kvm.coordinator.single_type_managers:
        if not getattr(manager, "_qwen_answer_unit", 0):
            continue
        if isinstance(manager, MambaManager):
            keep_answer_state(manager, request, finished=True)
        else:  # the attention entry, then vLLM's tail entry and the turn boundary again (shorter: re-added)
            manager._cache_partial_tail_block(request, request.num_computed_tokens)


def register_answer_entry(manager, request) -> bool:
    """Attention manager: a partial-block entry at the answer checkpoint (the running block's KV up to there is
    final). True when registered — it drops the block's shorter entries, which the caller re-adds."""
    c = _answer_position(manager, request, block_ends=False)
    if not c:
        return False
    block = manager.req_to_blocks[request.request_id][(c - 1) // manager.block_size]
    manager.block_pool.cache_partial_block(request=request, block=block, num_tokens=c,
                                           kv_cache_group_id=manager.kv_cache_group_id, block_size=manager.block_size)
    return True


def _prompt_tail(kvm, request) -> int:
    """Where vLLM keeps the prompt's own state (``get_mamba_prefill_checkpoint_position``): the prompt less its last
    token floored to the unit, or with the EAGLE drop the prompt floored to the unit less one unit."""
    unit, drop = kvm._qwen_turn_unit, getattr(kvm, "_qwen_drop", 0)
    if drop:
        return max(request.num_prompt_tokens // unit * unit - drop, 0)
    return (request.num_prompt_tokens - 1) // unit * unit


def _boundary(kvm, request) -> int:
    """The request's turn boundary (computed once per request), 0 when none or when the prompt's own tail
    checkpoint already covers it."""
    b = getattr(request, "_qwen_turn_boundary", None)
    if b is None:
        b = turn_boundary(request.prompt_token_ids or (), kvm._qwen_turn_opener, kvm._qwen_turn_unit)
        if b - getattr(kvm, "_qwen_drop", 0) >= _prompt_tail(kvm, request):
            b = 0
        request._qwen_turn_boundary = b
    return b


def install(settings) -> bool:
    """Wrap the hook points (idempotent). False when ``kv_turn_checkpoints`` is off."""
    if not getattr(settings, "kv_turn_checkpoints", False):
        return False
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, MambaManager

    from . import state_copies

    if getattr(KVCacheManager, _MARK, False):
        return True

    init = Scheduler.__init__

    @functools.wraps(init)
    def scheduler_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        why_not = enable(self, settings)
        if why_not is None:
            logger.info("qwen-vllm-ext: turn checkpoints on (the state where each chat request's next turn diverges "
                        "is kept; match unit %d)", self.hash_block_size)
            answer_why_not = self.kv_cache_manager._qwen_answer_why_not
            if answer_why_not is None:
                drop = self.kv_cache_manager._qwen_drop
                logger.info("qwen-vllm-ext: answer checkpoints on (the decode state every %d generated tokens, the "
                            "newest %s per request, so the next turn reuses the answer%s)", self.hash_block_size,
                            "two" if drop else "one",
                            "; speculative decoding: copied from each verify step's state columns" if drop else "")
            else:
                logger.info("qwen-vllm-ext: answer checkpoints off: %s", answer_why_not)
        elif why_not != NOT_HYBRID:  # dense models: nothing to say
            logger.info("qwen-vllm-ext: turn checkpoints off: %s", why_not)

    lookup = KVCacheManager.get_computed_blocks

    @functools.wraps(lookup)
    def get_computed_blocks(self, request, *args, **kwargs):  # 0.33 adds max_cache_hit_length
        blocks, num_hit, junction = lookup(self, request, *args, **kwargs)
        if getattr(self, "_qwen_turn_opener", None) is None:
            return blocks, num_hit, junction
        b = _boundary(self, request)
        if b:
            b -= getattr(self, "_qwen_drop", 0)  # the EAGLE drop: the state a unit before, the attention layers to b
        if b > num_hit:
            junction = b
        return blocks, num_hit, junction

    partial = FullAttentionManager._cache_partial_tail_block

    @functools.wraps(partial)
    def cache_partial_tail_block(self, request, num_tokens):
        try:
            attention_entries(self, request, num_tokens)
        finally:
            if getattr(self, "_qwen_spec", 0):
                step_scheduled(self, request)

    def attention_entries(self, request, num_tokens):
        answered = register_answer_entry(self, request)  # first: vLLM's tail entry and ours are shorter
        partial(self, request, num_tokens)
        b = getattr(request, "_qwen_turn_boundary", 0)
        if (not b or b - getattr(self, "_qwen_drop", 0) != request.shared_prefix_boundary or b > num_tokens
                or (num_tokens > request.num_prompt_tokens and not answered) or b % self.block_size == 0):
            return
        blocks = self.req_to_blocks[request.request_id]
        idx = b // self.block_size
        if idx < len(blocks) and not blocks[idx].is_null:
            # after vLLM's tail entry: registering the tail drops shorter entries of the same block
            self.block_pool.cache_partial_block(request=request, block=blocks[idx], num_tokens=b,
                                                kv_cache_group_id=self.kv_cache_group_id, block_size=self.block_size)

    mamba_partial = MambaManager._cache_partial_tail_block

    @functools.wraps(mamba_partial)
    def mamba_cache_partial_tail_block(self, request, *args, **kwargs):
        key = mamba_partial(self, request, *args, **kwargs)
        if key is None and getattr(self, "_qwen_answer_unit", 0):
            key = keep_answer_state(self, request)  # returned: cache_blocks defers same-step hits on it
        if getattr(self, "_qwen_spec", 0):
            step_scheduled(self, request)
        return key

    allocate = MambaManager.allocate_new_blocks

    @functools.wraps(allocate)
    def mamba_allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model, *args, **kwargs):
        blocks = allocate(self, request_id, num_tokens, num_tokens_main_model, *args, **kwargs)
        if getattr(self, "_qwen_spec", 0):
            record_state_columns(self, request_id, num_tokens_main_model)
        return blocks

    schedule = Scheduler.schedule

    @functools.wraps(schedule)
    def schedule_step(self, *args, **kwargs):
        output = schedule(self, *args, **kwargs)
        copies, held = take_state_copies(self.kv_cache_manager)
        if copies:  # run by the model runner first thing in this step (state_copies), before any block is reused
            setattr(output, state_copies.ATTR, copies)
            self.kv_cache_manager.block_pool.free_blocks(held)
        return output

    free = KVCacheManager.free

    @functools.wraps(free)
    def free_request(self, request):
        if getattr(self, "_qwen_answer_why_not", "") is None:
            keep_final_state(self, request)
        free(self, request)
        if getattr(self, "_qwen_state_copies", None) is not None:
            forget_state_columns(self, request)
        if getattr(self, "_qwen_turn_opener", None) is not None:
            demote_superseded(self, request)

    Scheduler.__init__ = scheduler_init
    KVCacheManager.get_computed_blocks = get_computed_blocks
    KVCacheManager.free = free_request
    FullAttentionManager._cache_partial_tail_block = cache_partial_tail_block
    MambaManager._cache_partial_tail_block = mamba_cache_partial_tail_block
    MambaManager.allocate_new_blocks = mamba_allocate_new_blocks
    Scheduler.schedule = schedule_step
    setattr(KVCacheManager, _MARK, True)
    return True
