"""Every metric the server's ``/metrics`` carries that the shipped rules and dashboard rely on: the extension's own
(``qwen_ext_*``, created from this catalog) and the vLLM ones we use (documented here, exported by vLLM).

One source of truth: the code that exports a ``qwen_ext_*`` metric takes its type, help text, labels and buckets
from here (:func:`counter`, :func:`gauge`, :func:`histogram` for prometheus_client objects, :func:`family` for
custom collectors), and ``docs/metrics.md`` is generated from it (``scripts/metrics_reference.py``; a test keeps
it current). Pure data apart from the lazy prometheus_client imports.

Label values are bounded by construction: codes and statuses come from fixed sets in the code, key ids only
through the top-k families (at most :data:`TOP_KEYS` keys + ``other``), model names only when served (else
``other``): no label takes a client's string.
"""
from __future__ import annotations

import dataclasses
import functools

TOP_KEYS = 10
"""Key ids the top-key families export (the rest are summed under ``key_id="other"``)."""
TOP_WINDOW_S = 300.0
"""The sliding window the top-key families count over."""


def per_key_series(settings) -> bool:
    """Do the top-key families export their ``key_id`` series? Not with the gateway on and no ``metrics_key``:
    ``/metrics`` is public then, and key ids with their traffic are not for whoever reaches the port (the families stay,
    with no samples; the aggregates are ``qwen_ext_ledger_tokens_total`` and ``qwen_ext_gateway_rejections_total``).
    With the gateway off there are no keys (``key_id=""``): exported as before."""
    return not settings.gateway or bool(settings.metrics_key)


@dataclasses.dataclass(frozen=True)
class Metric:
    name: str
    """The family name (counters are exposed with ``_total``, histograms with ``_bucket``/``_sum``/``_count``)."""
    type: str
    """counter, gauge or histogram."""
    help: str
    labels: tuple[str, ...] = ()
    home: str = ""
    """The module that exports it (vLLM's metric loggers for ``vllm:*``)."""
    buckets: tuple[float, ...] | None = None
    multiprocess_mode: str = "all"
    """For gauges when vLLM runs several API-server processes (prometheus_client multiprocess mode)."""

    @property
    def ours(self) -> bool:
        return self.name.startswith("qwen_ext_")

    def series_names(self) -> tuple[str, ...]:
        """The sample names Prometheus stores for this family."""
        if self.type == "counter":
            return (self.name + "_total",)
        if self.type == "histogram":
            return tuple(self.name + s for s in ("_bucket", "_sum", "_count"))
        return (self.name,)


_S = "qwen_vllm_ext.scheduling.metrics"
_KM = "qwen_vllm_ext.kv.metrics"
_U = "qwen_vllm_ext.usage.metrics"
_G = "qwen_vllm_ext.gateway.metrics"
_K = "qwen_vllm_ext.kv.server"
_I = "qwen_vllm_ext.integration.plugin"
_V = "vllm.v1.metrics.loggers"
_SPEC = "vllm.v1.spec_decode.metrics"

METRICS: tuple[Metric, ...] = (
    # ---- the extension ----------------------------------------------------------------------------------
    Metric("qwen_ext_build_info", "gauge", "Always 1: the extension and vLLM versions this server runs",
           ("version", "vllm_version"), _I, multiprocess_mode="max"),
    Metric("qwen_ext_runtime_patch_active", "gauge",
           "1 per runtime patch a process applied (or vLLM's source carries), 0 when the compatibility guard "
           "disabled it", ("patch", "role"), _I, multiprocess_mode="max"),
    # usage ledger
    Metric("qwen_ext_billed_units", "counter", "Billed units recorded in the usage ledger (model: a served model's "
           "name, 'other' for the rest)", ("model",), _U),
    Metric("qwen_ext_ledger_records", "counter", "Usage ledger records by status", ("status",), _U),
    Metric("qwen_ext_ledger_tokens", "counter", "Tokens recorded in the usage ledger by this process",
           ("kind",), _U),
    Metric("qwen_ext_ledger_queue_depth", "gauge", "Ledger records waiting to be committed", (), _U,
           multiprocess_mode="livesum"),
    Metric("qwen_ext_ledger_commit_wait_seconds", "histogram",
           "Time from a response's end to its ledger record being committed", (), _U,
           buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)),
    Metric("qwen_ext_ledger_write_failures", "counter",
           "Ledger records the store did not take after the retries (spilled to a file, or invalid)", (), _U),
    Metric("qwen_ext_ledger_spilled_records", "counter",
           "Ledger records written to a spill file because the store failed", (), _U),
    Metric("qwen_ext_ledger_replayed_records", "counter",
           "Spilled ledger records committed to the store later (at the next start or when it answered again)",
           (), _U),
    Metric("qwen_ext_ledger_spill_pending_records", "gauge",
           "Ledger records in spill files in the data_dir, waiting for the store (0 when none)", (), _U,
           multiprocess_mode="max"),
    Metric("qwen_ext_ledger_dead_lettered_records", "counter",
           "Ledger records that can never be written (invalid, or refused by a store that took the rest of their "
           "batch), kept with the reason in ledger-deadletter-*.jsonl in the data_dir", (), _U),
    Metric("qwen_ext_ledger_writer_up", "gauge",
           "1 while the ledger writer thread runs, 0 once it stopped (vLLM's /health then answers 503)", (), _U,
           multiprocess_mode="livemin"),
    Metric("qwen_ext_ledger_writer_errors", "counter",
           "Unexpected errors the ledger writer thread caught and survived (e.g. too many open files during a "
           "spill replay)", (), _U),
    Metric("qwen_ext_ledger_instance_tokens", "gauge",
           "The ledger store's token totals for this server instance, read from the store (compare with "
           "vllm:prompt_tokens_total / vllm:generation_tokens_total: the exact drift)",
           ("kind",), _U, multiprocess_mode="max"),
    Metric("qwen_ext_kv_reuse_ratio", "histogram",
           "Per conversation turn: cached tokens / previous turn's prompt + completion tokens", (), _U,
           buckets=(0.1, 0.25, 0.5, 0.75, 0.8, 0.85, 0.9, 0.95, 0.99, 1.0)),
    Metric("qwen_ext_top_key_tokens", "gauge",
           f"Prompt + completion tokens in the last {TOP_WINDOW_S:.0f} s of the {TOP_KEYS} busiest API keys "
           "(key_id; 'other': the rest, '': no key; with the gateway on, only when the metrics_key setting guards "
           "/metrics)", ("key_id",), _U),
    # gateway
    Metric("qwen_ext_gateway_admissions", "counter", "Requests the gateway admitted to the engine", (), _G),
    Metric("qwen_ext_gateway_rejections", "counter",
           "Requests the gateway answered itself with an error, by OpenAI error code and HTTP status",
           ("code", "http_status"), _G),
    Metric("qwen_ext_gateway_overhead_seconds", "histogram",
           "Time the gateway spent on an admitted request before the engine saw it (auth, body checks, exact "
           "count, reservations)", (), _G,
           buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)),
    Metric("qwen_ext_top_key_rejections", "gauge",
           f"Gateway rejections in the last {TOP_WINDOW_S:.0f} s of the {TOP_KEYS} most rejected API keys "
           "(key_id; 'other': the rest; only when the metrics_key setting guards /metrics)", ("key_id",), _G),
    Metric("qwen_ext_store_errors", "counter",
           "Failed calls to a shared store (keys, limiter, ledger): each one a 503, a fail-open admission or a "
           "spilled batch", ("store",), "qwen_vllm_ext.observability.stores"),
    Metric("qwen_ext_store_up", "gauge", "1 when the last call to the store succeeded, 0 when it failed",
           ("store",), "qwen_vllm_ext.observability.stores", multiprocess_mode="min"),
    Metric("qwen_ext_keys_suspended", "counter", "API keys suspended by the spike breaker", (),
           "qwen_vllm_ext.gateway.server"),
    Metric("qwen_ext_sse_keepalives", "counter", "SSE keep-alive comments sent on idle streamed responses", (),
           "qwen_vllm_ext.provider.server"),
    Metric("qwen_ext_expected_queue_wait_seconds", "gauge",
           "Expected queue wait of a new request (capacity 429s): prompt tokens admitted and not yet started over "
           "the measured start rate", (), "qwen_vllm_ext.gateway.capacity", multiprocess_mode="max"),
    # engine idle sleep
    Metric("qwen_ext_engine_sleeps", "counter", "Times the idle engine was put to sleep", (), _K),
    Metric("qwen_ext_engine_wakes", "counter", "Times a request woke the sleeping engine", (), _K),
    Metric("qwen_ext_engine_wake_failures", "counter",
           "Wakes of the sleeping engine that failed (the waiting requests got 503)", (), _K),
    Metric("qwen_ext_engine_wake_seconds", "histogram", "Time to wake the engine (requests wait for it)", (), _K,
           buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80)),
    Metric("qwen_ext_engine_asleep", "gauge", "1 while the engine sleeps", (), _K, multiprocess_mode="max"),
    # token-weighted scheduler (published by the engine core, one series per engine-core pid)
    Metric("qwen_ext_kv_answer_state_copies", "counter",
           "Hybrid models: decode states copied into a kept block (answer checkpoints)", ("pid",), _KM),
    Metric("qwen_ext_kv_answer_state_copies_skipped", "counter",
           "Hybrid models: answer-state copies skipped because free blocks ran low (a copy never takes a running "
           "request's block)", ("pid",), _KM),
    Metric("qwen_ext_kv_states_superseded", "counter",
           "Hybrid models: kept states a newer state of the same conversation superseded, moved to the front of the "
           "eviction queue", ("pid",), _KM),
    Metric("qwen_ext_sched_admitted", "counter", "Requests admitted by the token-weighted scheduler", ("pid",), _S),
    Metric("qwen_ext_sched_max_wait_admissions", "counter",
           "Admissions through the arrival-order lane after waiting sched_max_wait_s", ("pid",), _S),
    Metric("qwen_ext_sched_slip_admissions", "counter",
           "Admissions through the arrival-order lane at their FCFS slip deadline", ("pid",), _S),
    Metric("qwen_ext_sched_cache_hit_tokens", "counter", "Prefix-cache hit tokens at admission", ("pid",), _S),
    Metric("qwen_ext_sched_admitted_weight", "counter",
           "Token weight admitted from the waiting queue (the aging work clock)", ("pid",), _S),
    Metric("qwen_ext_sched_admitted_weight_std", "gauge",
           "Standard deviation of admitted request weights in the last step", ("pid",), _S),
    Metric("qwen_ext_sched_admitted_weight_std_mean", "gauge",
           "Mean per-step standard deviation of admitted weights (recent steps)", ("pid",), _S),
    Metric("qwen_ext_sched_queue_wait_p50_seconds", "gauge", "Queue wait p50 (recent admissions)", ("pid",), _S),
    Metric("qwen_ext_sched_queue_wait_p99_seconds", "gauge", "Queue wait p99 (recent admissions)", ("pid",), _S),
    Metric("qwen_ext_sched_load_factor", "gauge",
           "Measured overload factor: weight arriving / weight admitted per second (>= 1)", ("pid",), _S),
    Metric("qwen_ext_sched_aging_half_life_tokens", "gauge",
           "Aging half-life in use on the work clock, tokens of admitted weight (load-scaled)", ("pid",), _S),
    Metric("qwen_ext_sched_aging_half_life_seconds", "gauge",
           "Aging half-life in use on the seconds clock (load-scaled)", ("pid",), _S),
    Metric("qwen_ext_sched_output_token_weight", "gauge",
           "Measured weight of one output token in prompt tokens (absent: token weight)", ("pid",), _S),
    Metric("qwen_ext_sched_cost_steps_fitted", "gauge", "Engine steps the online step-cost fit has seen",
           ("pid",), _S),
    Metric("qwen_ext_sched_overloaded", "gauge",
           "token_weighted_scheduler=auto: 1 while the overload gate lets the policy order the queue, 0 while the "
           "queue is exactly vLLM's FCFS (absent: not gated)", ("pid",), _S),
    Metric("qwen_ext_sched_backlog_steps", "gauge",
           "token_weighted_scheduler=auto: full steps the waiting requests' prefill needs to start (the gate's "
           "measure)", ("pid",), _S),
    Metric("qwen_ext_sched_gate_switches", "counter",
           "token_weighted_scheduler=auto: times the overload gate turned on or off", ("pid",), _S),
    # ---- vLLM's, used by the rules and the dashboard ---------------------------------------------------------
    Metric("vllm:prompt_tokens", "counter", "Prompt tokens prefilled (cached included)", ("model_name", "engine"),
           _V),
    Metric("vllm:generation_tokens", "counter", "Tokens generated", ("model_name", "engine"), _V),
    Metric("vllm:prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache",
           ("model_name", "engine"), _V),
    Metric("vllm:prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache",
           ("model_name", "engine"), _V),
    Metric("vllm:num_requests_running", "gauge", "Requests in the engine's running batch", ("model_name", "engine"),
           _V),
    Metric("vllm:num_requests_waiting", "gauge", "Requests waiting for the scheduler", ("model_name", "engine"),
           _V),
    Metric("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage (0-1)", ("model_name", "engine"), _V),
    Metric("vllm:engine_sleep_state", "gauge",
           "Sleep state: sleep_state=\"awake\" is 1 while the engine is awake, 0 asleep",
           ("model_name", "engine", "sleep_state"), _V),
    Metric("vllm:num_preemptions", "counter", "Requests preempted (KV cache full)", ("model_name", "engine"), _V),
    Metric("vllm:admission_rejections", "counter", "Admission attempts rejected by a vLLM queue limit",
           ("model_name", "reason"), _V),
    Metric("vllm:time_to_first_token_seconds", "histogram", "Time to first token", ("model_name", "engine"), _V),
    Metric("vllm:inter_token_latency_seconds", "histogram", "Time between output tokens (TPOT)",
           ("model_name", "engine"), _V),
    Metric("vllm:e2e_request_latency_seconds", "histogram", "End-to-end request latency", ("model_name", "engine"),
           _V),
    Metric("vllm:request_queue_time_seconds", "histogram", "Time requests spent waiting in the engine's queue",
           ("model_name", "engine"), _V),
    # speculative decoding (MTP): exported only by an engine with a speculative config
    Metric("vllm:spec_decode_num_drafts", "counter", "Draft steps proposed (speculative decoding)",
           ("model_name", "engine"), _SPEC),
    Metric("vllm:spec_decode_num_draft_tokens", "counter", "Draft tokens proposed", ("model_name", "engine"), _SPEC),
    Metric("vllm:spec_decode_num_accepted_tokens", "counter", "Draft tokens accepted by the target model",
           ("model_name", "engine"), _SPEC),
)

_BY_NAME = {m.name: m for m in METRICS}


def spec(name: str) -> Metric:
    return _BY_NAME[name]


def by_series() -> dict[str, Metric]:
    """Sample name (``qwen_ext_billed_units_total``, ``…_bucket``, a gauge's name) -> its family."""
    return {s: m for m in METRICS for s in m.series_names()}


def _check(name: str, type_: str) -> Metric:
    m = spec(name)
    if m.type != type_ or not m.ours:
        raise ValueError(f"{name} is a {m.type} ({'ours' if m.ours else 'vLLM'}'s), not one of our {type_}s")
    return m


@functools.lru_cache(maxsize=None)
def counter(name: str):
    from prometheus_client import Counter

    m = _check(name, "counter")
    return Counter(m.name, m.help, list(m.labels))


@functools.lru_cache(maxsize=None)
def gauge(name: str):
    from prometheus_client import Gauge

    m = _check(name, "gauge")
    return Gauge(m.name, m.help, list(m.labels), multiprocess_mode=m.multiprocess_mode)


@functools.lru_cache(maxsize=None)
def histogram(name: str):
    from prometheus_client import Histogram

    m = _check(name, "histogram")
    return Histogram(m.name, m.help, list(m.labels), buckets=m.buckets)


_custom: list = []


def register_collector(collector) -> None:
    """Register a custom collector on prometheus_client's default registry and remember it: with several API-server
    processes vLLM serves a multiprocess registry instead, and the integration layer adds these to that
    (:func:`custom_collectors`). Values a custom collector computes are this process's (a scrape reaches one process):
    keep per-process counts in real counters, which aggregate across processes."""
    from prometheus_client import REGISTRY

    REGISTRY.register(collector)
    _custom.append(collector)


def unregister_collector(collector) -> None:
    from prometheus_client import REGISTRY

    REGISTRY.unregister(collector)
    _custom.remove(collector)


def custom_collectors() -> list:
    return list(_custom)


class PublishedStatsCollector:
    """prometheus_client custom collector for counters and gauges another process publishes: at scrape time, each
    live process's record (``reader()``: a list of ``{"pid", "stats"}``) gives one sample per ``stats`` field of
    ``fields`` (field -> metric name), labelled with its pid. Register once per API-server process."""

    def __init__(self, reader, fields: dict[str, str]):
        self.reader, self.fields = reader, fields

    def collect(self):
        published = self.reader()
        for field, name in self.fields.items():
            out = family(name)
            for record in published:
                value = (record.get("stats") or {}).get(field)
                if value is not None:
                    out.add_metric([str(record["pid"])], value)
            yield out


def family(name: str):
    """A fresh metric family for a custom collector's ``collect()`` (counter or gauge), labelled as catalogued."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    m = spec(name)
    if not m.ours or m.type not in ("counter", "gauge"):
        raise ValueError(f"{name}: custom collectors export our counters and gauges only")
    cls = CounterMetricFamily if m.type == "counter" else GaugeMetricFamily
    return cls(m.name, m.help, labels=list(m.labels))
