"""vLLM glue: report every engine request's final counts from vLLM's output processor to the account book.

The only module of the usage capability that touches vLLM's engine internals (``vllm/v1/engine/output_processor.py``).
Hooks (in each API-server process; applied idempotently by the general plugin):

* ``OutputProcessor.add_request``               -> ``BOOK.engine_opened(HTTP request key)``; the key is the
  ledger middleware's context variable, visible here because vLLM adds requests from the HTTP request's tasks
* ``OutputProcessor._update_stats_from_finished`` -> ``BOOK.engine_finished(...)`` (stop, length, error, ...)
* ``OutputProcessor.abort_requests``            -> ``BOOK.engine_finished(..., "abort")`` for each request it drops

Engine requests added outside a tracked HTTP request (other endpoints, offline use) are not followed.

The counts are the ones vLLM's own statistics use (``RequestState.stats.num_generation_tokens``; the prompt
counts once its first output arrived), so the ledger and ``vllm:*_tokens_total`` agree exactly. Reasoning tokens are
counted here too, from the request's prompt and generated ids (``accounting.reasoning_tokens``): vLLM's streaming
count lags by the tokens its detokenizer still holds back (measured: 59 of 60 on the hybrid demo).
"""
from __future__ import annotations

import functools
import time

from .accounting import BOOK, CURRENT_HTTP_REQUEST, EngineCounts, reasoning_tokens

_FINISH = {"stop": "stop", "length": "length", "abort": "abort", "error": "error", "repetition": "stop"}
_MARK = "_qwen_vllm_ext_usage_hooked"

# Compatibility guard (qwen_vllm_ext.integration.guard): what install() wraps -> fingerprint per vLLM version.
# Regenerate with `python -m qwen_vllm_ext.patches fingerprints` after checking the code against a new vLLM.
PATCH_TARGETS = {
    "vllm.v1.engine.output_processor:OutputProcessor.add_request": {"0.32.0": "9a8370d9c58bce88", "0.33.0": "9a8370d9c58bce88"},
    "vllm.v1.engine.output_processor:OutputProcessor._update_stats_from_finished": {"0.32.0": "4604a21811e57a9f", "0.33.0": "4604a21811e57a9f"},
    "vllm.v1.engine.output_processor:OutputProcessor.abort_requests": {"0.32.0": "e674d9f6eee38e68", "0.33.0": "e674d9f6eee38e68"},
}
_OWNER: dict[str, str] = {}  # vLLM internal request id -> HTTP request key


def think_markers(tokenizer) -> tuple[int | None, int | None]:
    """Ids of ``<think>`` and ``</think>`` in a vLLM/HF tokenizer (None where it has none)."""
    cached = getattr(tokenizer, "_qwen_vllm_ext_think", None)
    if cached is not None:
        return cached
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 - no tokenizer (skip_tokenizer_init) or an unusual one: no reasoning count
        vocab = {}
    markers = (vocab.get("<think>"), vocab.get("</think>"))
    try:
        tokenizer._qwen_vllm_ext_think = markers
    except AttributeError:
        pass
    return markers


def _reasoning(req_state, tokenizer) -> int:
    detok = req_state.detokenizer
    if tokenizer is None or detok is None:
        return 0
    try:
        output_ids = detok.output_token_ids
    except (AttributeError, NotImplementedError):
        return 0
    return reasoning_tokens(req_state.prompt_token_ids, output_ids, *think_markers(tokenizer))


def _counts(req_state, finish: str, tokenizer=None) -> EngineCounts:
    stats = req_state.stats
    if stats is not None:
        completion = stats.num_generation_tokens
        arrival = stats.arrival_time
        ttft = stats.first_token_latency or None
    else:
        completion = req_state.detokenizer.num_output_tokens() if req_state.detokenizer is not None else 0
        arrival, ttft = time.time(), None
    return EngineCounts(
        external_id=req_state.external_req_id,
        prompt_tokens=req_state.prompt_len,
        prefilled=not req_state.is_prefilling,
        cached_tokens=req_state.num_cached_tokens,
        completion_tokens=completion,
        finish_reason=finish,
        arrival_time=arrival,
        first_token_latency=ttft,
        finished_at=time.time(),
        reasoning_tokens=_reasoning(req_state, tokenizer),
    )


def install(settings=None) -> bool:
    """Wrap the three OutputProcessor methods (idempotent). Returns True when active."""
    from vllm.v1.engine.output_processor import OutputProcessor

    if getattr(OutputProcessor, _MARK, False):
        return True
    add_request = OutputProcessor.add_request
    finished = OutputProcessor._update_stats_from_finished
    abort_requests = OutputProcessor.abort_requests

    @functools.wraps(add_request)
    def add_request_hook(self, request, *args, **kwargs):
        key = CURRENT_HTTP_REQUEST.get()
        new = request.request_id not in self.request_states
        result = add_request(self, request, *args, **kwargs)
        if key is not None and new and request.request_id in self.request_states:
            _OWNER[request.request_id] = key
            BOOK.engine_opened(key)
        return result

    @functools.wraps(finished)
    def finished_hook(self, req_state, finish_reason, iteration_stats):
        key = _OWNER.pop(req_state.request_id, None)
        if key is not None:
            BOOK.engine_finished(key, _counts(req_state, _FINISH.get(str(finish_reason).lower(), "stop"),
                                              getattr(self, "tokenizer", None)))
        return finished(self, req_state, finish_reason, iteration_stats)

    @functools.wraps(abort_requests)
    def abort_hook(self, request_ids, *args, **kwargs):
        request_ids = list(request_ids)
        before = {}  # the states this call may drop (not a copy of every running request)
        for rid in request_ids:
            for iid in (rid, *self.external_req_ids.get(rid, ())):
                if iid in self.request_states:
                    before[iid] = self.request_states[iid]
        aborted = abort_requests(self, request_ids, *args, **kwargs)
        for rid in aborted:
            req_state = before.get(rid)
            key = _OWNER.pop(rid, None)
            if req_state is not None and key is not None and rid not in self.request_states:
                BOOK.engine_finished(key, _counts(req_state, "abort", getattr(self, "tokenizer", None)))
        return aborted

    OutputProcessor.add_request = add_request_hook
    OutputProcessor._update_stats_from_finished = finished_hook
    OutputProcessor.abort_requests = abort_hook
    setattr(OutputProcessor, _MARK, True)
    return True
