"""vLLM glue (engine-core process): turn checkpoints on hybrid models — the only module of this capability that
touches vLLM's KV-cache manager (``vllm/v1/core``).

On a hybrid model (Gated DeltaNet + attention, prefix caching in ``align`` mode with a match unit finer than the
block) each chat request gets one extra kept state: where the next turn's prompt will diverge from this one
(:func:`.checkpoints.turn_boundary`, just after the last ``<|im_start|>assistant\\n``). The next turn then resumes
there instead of falling back to an older checkpoint. The mechanism is vLLM's own shared-prefix junction
(``request.shared_prefix_boundary``): the scheduler ends a prefill chunk at the junction and the Mamba manager
keeps the state there (copy-on-write when it lies inside a block). Upstream enables it only for EAGLE siblings;
here it is enabled for every align-mode hybrid engine and the junction is set to the turn boundary.

Hooks (applied idempotently by the general plugin when ``kv_turn_checkpoints`` is on):

* ``Scheduler.__init__``        -> turns the junction checkpoint on in the scheduler and the Mamba managers when
  the engine qualifies (align mode, fine-grained hits, no MTP re-prefill tail, a tokenizer to find the opener);
* ``KVCacheManager.get_computed_blocks`` -> returns the turn boundary as the junction when it lies beyond the hit
  and before the prompt's own tail checkpoint (else vLLM's junction, unchanged);
* ``FullAttentionManager._cache_partial_tail_block`` -> also registers the attention layers' partial block entry
  at the turn boundary (vLLM registers only the prompt tail), so attention can hit there too.

Targets the behaviour depends on without wrapping them are fingerprinted as well (the scheduler's chunk split at
the junction, the Mamba manager's junction caching).
"""
from __future__ import annotations

import functools
import logging

from .checkpoints import turn_boundary

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


def enable(scheduler) -> str | None:
    """Turn the junction checkpoint on for ``scheduler``'s engine and give its KV-cache manager the opener ids.
    Returns None when enabled, else why not (logged)."""
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

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
    return None


def _boundary(kvm, request) -> int:
    """The request's turn boundary (computed once per request), 0 when none or when the prompt's own tail
    checkpoint already covers it."""
    b = getattr(request, "_qwen_turn_boundary", None)
    if b is None:
        unit = kvm._qwen_turn_unit
        b = turn_boundary(request.prompt_token_ids or (), kvm._qwen_turn_opener, unit)
        tail = (request.num_prompt_tokens - 1) // unit * unit  # vLLM's prompt checkpoint (no EAGLE drop)
        if b >= tail:
            b = 0
        request._qwen_turn_boundary = b
    return b


def install(settings) -> bool:
    """Wrap the three hook points (idempotent). False when ``kv_turn_checkpoints`` is off."""
    if not getattr(settings, "kv_turn_checkpoints", False):
        return False
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    if getattr(KVCacheManager, _MARK, False):
        return True

    init = Scheduler.__init__

    @functools.wraps(init)
    def scheduler_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        why_not = enable(self)
        if why_not is None:
            logger.info("qwen-vllm-ext: turn checkpoints on (the state where each chat request's next turn diverges "
                        "is kept; match unit %d)", self.hash_block_size)
        elif why_not != NOT_HYBRID:  # dense models: nothing to say
            logger.info("qwen-vllm-ext: turn checkpoints off: %s", why_not)

    lookup = KVCacheManager.get_computed_blocks

    @functools.wraps(lookup)
    def get_computed_blocks(self, request, *args, **kwargs):  # 0.33 adds max_cache_hit_length
        blocks, num_hit, junction = lookup(self, request, *args, **kwargs)
        if getattr(self, "_qwen_turn_opener", None) is None:
            return blocks, num_hit, junction
        b = _boundary(self, request)
        if b > num_hit:
            junction = b
        return blocks, num_hit, junction

    partial = FullAttentionManager._cache_partial_tail_block

    @functools.wraps(partial)
    def cache_partial_tail_block(self, request, num_tokens):
        partial(self, request, num_tokens)
        b = getattr(request, "_qwen_turn_boundary", 0)
        if (not b or b != request.shared_prefix_boundary or b > num_tokens
                or num_tokens > request.num_prompt_tokens or b % self.block_size == 0):
            return
        blocks = self.req_to_blocks[request.request_id]
        idx = b // self.block_size
        if idx < len(blocks) and not blocks[idx].is_null:
            # after vLLM's tail entry: registering the tail drops shorter entries of the same block
            self.block_pool.cache_partial_block(request=request, block=blocks[idx], num_tokens=b,
                                                kv_cache_group_id=self.kv_cache_group_id, block_size=self.block_size)

    Scheduler.__init__ = scheduler_init
    KVCacheManager.get_computed_blocks = get_computed_blocks
    FullAttentionManager._cache_partial_tail_block = cache_partial_tail_block
    setattr(KVCacheManager, _MARK, True)
    return True
