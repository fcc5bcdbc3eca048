"""Hybrid KV reuse's engine-core counters on the API server's ``/metrics`` (issue 48).

The turn and answer checkpoints run in the engine-core process (:mod:`qwen_vllm_ext.kv.hybrid_checkpoints`); it
publishes its counters once a second to the server's instance directory (``kv-<pid>.json``,
:mod:`qwen_vllm_ext.observability.status`). This collector reads those files at scrape time, as the scheduler's does.
"""
from __future__ import annotations

from ..observability import catalog, status

COUNTERS = {"answer_copies": "qwen_ext_kv_answer_state_copies",
            "answer_copies_skipped": "qwen_ext_kv_answer_state_copies_skipped",
            "states_demoted": "qwen_ext_kv_states_superseded"}
"""Published ``stats`` field -> metric (help text and labels in the catalog)."""


def kv_status() -> list[dict]:
    """Published counters of every live engine core with turn checkpoints on."""
    return status.read_processes("kv-*.json")


class KvCollector(catalog.PublishedStatsCollector):
    """prometheus_client custom collector (register once per API-server process)."""

    def __init__(self):
        super().__init__(kv_status, COUNTERS)
