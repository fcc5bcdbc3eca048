#!/usr/bin/env python
"""Build the Grafana dashboard for qwen-vllm-ext replicas: ``deploy/grafana/qwen-vllm-ext.json``.

This script is the source of truth (a test rebuilds it and compares with the committed JSON, then evaluates every
query against a real Prometheus scraping a real server). Import the JSON in Grafana (Dashboards -> New -> Import),
pick your Prometheus data source; the variables select models (``model_name`` of vLLM's series) and replicas
(``instance``).

    python deploy/grafana/build_dashboard.py           # rewrite the JSON
    python deploy/grafana/build_dashboard.py --check   # exit 1 when the committed JSON is stale
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OUT = Path(__file__).with_name("qwen-vllm-ext.json")
UID = "qwen-vllm-ext"
DS = {"type": "prometheus", "uid": "${datasource}"}
M = 'model_name=~"$model", instance=~"$instance"'  # vLLM series
I = 'instance=~"$instance"'  # the extension's series (no model label, or `model` for billing)
RATE = "$__rate_interval"


def q(expr: str, legend: str = "", instant: bool = False) -> dict:
    target = {"datasource": DS, "expr": expr, "legendFormat": legend or "__auto", "refId": ""}
    if instant:
        target.update(instant=True, range=False, format="table")
    return target


def quantiles(metric: str, sel: str, by: str = "") -> list[dict]:
    group = f"{by}, le" if by else "le"
    return [q(f"histogram_quantile({p}, sum by ({group}) (rate({metric}_bucket{{{sel}}}[{RATE}])))",
              f"p{int(p * 100)}" + (f" {{{{{by}}}}}" if by else "")) for p in (0.5, 0.99)]


def panel(title: str, targets: list[dict], unit: str = "short", kind: str = "timeseries", description: str = "",
          w: int = 8, h: int = 8, **options) -> dict:
    return {"type": kind, "title": title, "description": description, "datasource": DS, "targets": targets,
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []}, "options": options, "_w": w, "_h": h}


def row(title: str) -> dict:
    return {"type": "row", "title": title, "collapsed": False, "panels": [], "_w": 24, "_h": 1}


PANELS = [
    row("Traffic and billing"),
    panel("Prompt tokens/s by model", [q(f"sum by (model_name) (rate(vllm:prompt_tokens_total{{{M}}}[{RATE}]))",
                                         "{{model_name}}")], "short",
          description="Prompt tokens prefilled per second (cached included), vLLM's counter."),
    panel("Output tokens/s by model", [q(f"sum by (model_name) (rate(vllm:generation_tokens_total{{{M}}}[{RATE}]))",
                                         "{{model_name}}")], "short"),
    panel("Billed units/s by model", [q(f'sum by (model) (rate(qwen_ext_billed_units_total{{{I}, model=~"$model"}}'
                                        f"[{RATE}]))", "{{model}}")], "short",
          description="Billed units recorded in the usage ledger (billing_policy weights and context penalty)."),
    panel("Cached-token share", [q(f"sum(rate(vllm:prefix_cache_hits_total{{{M}}}[{RATE}])) / "
                                   f"sum(rate(vllm:prefix_cache_queries_total{{{M}}}[{RATE}]))", "prefix-cache hits")],
          "percentunit", description="Prompt tokens served from the prefix cache / prompt tokens looked up."),
    panel("KV reuse per conversation turn", quantiles("qwen_ext_kv_reuse_ratio", I)
          + [q(f"sum(rate(qwen_ext_kv_reuse_ratio_count{{{I}}}[{RATE}]))", "turns/s")], "percentunit",
          description="Cached tokens / the previous turn's prompt + completion (requests with a conversation id)."),
    panel("Requests running and waiting", [q(f"sum(vllm:num_requests_running{{{M}}})", "running"),
                                           q(f"sum(vllm:num_requests_waiting{{{M}}})", "waiting")], "short"),
    row("Latency"),
    panel("Time to first token", quantiles("vllm:time_to_first_token_seconds", M), "s"),
    panel("Time per output token", quantiles("vllm:inter_token_latency_seconds", M), "s"),
    panel("End-to-end latency", quantiles("vllm:e2e_request_latency_seconds", M), "s"),
    panel("Engine queue time", quantiles("vllm:request_queue_time_seconds", M), "s"),
    panel("KV-cache usage", [q(f"max by (instance) (vllm:kv_cache_usage_perc{{{M}}})", "{{instance}}")],
          "percentunit", description="Alert above 0.92 sustained (QwenVllmKvCacheNearlyFull)."),
    panel("Preemptions/s", [q(f"sum by (instance) (rate(vllm:num_preemptions_total{{{M}}}[{RATE}]))",
                              "{{instance}}")], "short"),
    panel("Speculative decoding (MTP): draft acceptance", [
        q(f"sum by (model_name) (rate(vllm:spec_decode_num_accepted_tokens_total{{{M}}}[{RATE}])) / "
          f"sum by (model_name) (rate(vllm:spec_decode_num_draft_tokens_total{{{M}}}[{RATE}]))",
          "accepted share {{model_name}}"),
        q(f"1 + sum by (model_name) (rate(vllm:spec_decode_num_accepted_tokens_total{{{M}}}[{RATE}])) / "
          f"sum by (model_name) (rate(vllm:spec_decode_num_drafts_total{{{M}}}[{RATE}]))",
          "tokens per step {{model_name}}")], "short",
          description="Share of MTP draft tokens the target accepted, and tokens emitted per decode step (1 + "
                      "accepted per draft step). Empty without a speculative config (mtp_speculative_tokens)."),
    row("Token-weighted scheduler"),
    panel("Scheduler load factor", [q(f"max by (instance) (qwen_ext_sched_load_factor{{{I}}})", "{{instance}}")],
          "short", description="Token weight arriving / admitted per second (>= 1; token-weighted scheduler only)."),
    panel("Scheduler queue wait", [
        q(f"max by (instance) (qwen_ext_sched_queue_wait_p50_seconds{{{I}}})", "p50 {{instance}}"),
        q(f"max by (instance) (qwen_ext_sched_queue_wait_p99_seconds{{{I}}})", "p99 {{instance}}")], "s"),
    panel("Starvation and slip lanes", [
        q(f"sum(rate(qwen_ext_sched_max_wait_admissions_total{{{I}}}[{RATE}]))", "max-wait admissions/s"),
        q(f"sum(rate(qwen_ext_sched_slip_admissions_total{{{I}}}[{RATE}]))", "slip admissions/s"),
        q(f"sum(rate(qwen_ext_sched_admitted_total{{{I}}}[{RATE}]))", "admissions/s")], "short"),
    row("Admission (gateway)"),
    panel("Admissions and rejections by code", [
        q(f"sum(rate(qwen_ext_gateway_admissions_total{{{I}}}[{RATE}]))", "admitted"),
        q(f"sum by (code, http_status) (rate(qwen_ext_gateway_rejections_total{{{I}}}[{RATE}]))",
          "{{http_status}} {{code}}")], "reqps"),
    panel("Gateway overhead per admitted request", quantiles("qwen_ext_gateway_overhead_seconds", I), "s",
          description="Auth, body checks, exact prompt count and reservations, before the engine sees the request."),
    panel("Store health", [q(f"min by (store) (qwen_ext_store_up{{{I}}})", "up {{store}}"),
                           q(f"sum by (store) (rate(qwen_ext_store_errors_total{{{I}}}[{RATE}]))", "errors/s {{store}}")],
          "short", description="Keys, limiter and ledger stores (Redis or SQLite) as the replicas see them."),
    panel("Top keys by tokens (last 5 min)", [q(f"topk(10, sum by (key_id) (qwen_ext_top_key_tokens{{{I}}}))",
                                                "{{key_id}}", instant=True)], "short", kind="bargauge", w=12,
          description="The 10 busiest API keys per replica ('other': the rest), summed over the selected replicas."),
    panel("Top keys by rejections (last 5 min)", [q(f"topk(10, sum by (key_id) (qwen_ext_top_key_rejections{{{I}}}))",
                                                    "{{key_id}}", instant=True)], "short", kind="bargauge", w=12),
    row("Usage ledger"),
    panel("Ledger drift (engine - ledger tokens)", [
        q(f"sum by (instance) (vllm:prompt_tokens_total{{{M}}}) - sum by (instance) "
          f'(qwen_ext_ledger_instance_tokens{{{I}, kind="engine_prompt"}})', "prompt {{instance}}"),
        q(f"sum by (instance) (vllm:generation_tokens_total{{{M}}}) - sum by (instance) "
          f'(qwen_ext_ledger_instance_tokens{{{I}, kind="completion"}})', "completion {{instance}}")], "short",
          description="0 when idle; requests in flight while busy. A lasting difference is lost or double-counted "
                      "records (QwenExtLedgerEngineTokenDrift)."),
    panel("Ledger records/s by status", [q(f"sum by (status) (rate(qwen_ext_ledger_records_total{{{I}}}[{RATE}]))",
                                           "{{status}}")], "short"),
    panel("Ledger queue and commit wait", [
        q(f"max(qwen_ext_ledger_queue_depth{{{I}}})", "queue depth"),
        *quantiles("qwen_ext_ledger_commit_wait_seconds", I)], "short"),
    panel("Ledger spills", [
        q(f"sum(rate(qwen_ext_ledger_spilled_records_total{{{I}}}[{RATE}]))", "spilled/s"),
        q(f"sum(rate(qwen_ext_ledger_replayed_records_total{{{I}}}[{RATE}]))", "replayed/s"),
        q(f"sum(rate(qwen_ext_ledger_write_failures_total{{{I}}}[{RATE}]))", "write failures/s"),
        q(f"sum(qwen_ext_ledger_spill_pending_records{{{I}}})", "pending in spill files"),
        q(f"sum(increase(qwen_ext_ledger_dead_lettered_records_total{{{I}}}[{RATE}]))", "dead-lettered"),
        q(f"count(qwen_ext_ledger_writer_up{{{I}}} == 0) or vector(0)", "writers stopped")], "short"),
    row("Extension"),
    panel("Runtime patches", [q(f"min by (patch) (qwen_ext_runtime_patch_active{{{I}}})", "{{patch}}",
                                instant=True)], "short", kind="stat", w=12,
          description="1: active on every selected replica; 0: disabled by the compatibility guard somewhere."),
    panel("Engine sleep and build", [
        q(f"max by (instance) (qwen_ext_engine_asleep{{{I}}})", "asleep {{instance}}"),
        q(f"sum(increase(qwen_ext_engine_wakes_total{{{I}}}[{RATE}]))", "wakes"),
        q(f"sum(increase(qwen_ext_engine_wake_failures_total{{{I}}}[{RATE}]))", "wake failures"),
        q(f"count by (version, vllm_version) (qwen_ext_build_info{{{I}}})", "{{version}} on vLLM {{vllm_version}}")],
          "short", w=12),
]


def variables() -> list[dict]:
    def query_var(name: str, label: str, query: str) -> dict:
        return {"name": name, "label": label, "type": "query", "datasource": DS, "query": {"query": query,
                "refId": name}, "definition": query, "refresh": 2, "includeAll": True, "multi": True,
                "allValue": ".*", "current": {"text": "All", "value": "$__all"}, "sort": 1}

    return [
        {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
         "current": {}, "hide": 0},
        query_var("model", "Model", "label_values(vllm:generation_tokens_total, model_name)"),
        query_var("instance", "Replica", 'label_values(vllm:generation_tokens_total{model_name=~"$model"}, instance)'),
    ]


def build() -> dict:
    panels, x, y, row_h = [], 0, 0, 0
    for i, p in enumerate(PANELS, start=1):
        p = dict(p)
        w, h = p.pop("_w"), p.pop("_h")
        if p["type"] == "row" or x + w > 24:
            x, y = 0, y + row_h
            row_h = 0
        p["id"], p["gridPos"] = i, {"x": x, "y": y, "w": w, "h": h}
        for n, t in enumerate(p.get("targets", [])):
            t["refId"] = chr(ord("A") + n)
        x, row_h = x + w, max(row_h, h)
        if p["type"] == "row":
            x, y, row_h = 0, y + h, 0
        panels.append(p)
    return {
        "uid": UID, "title": "qwen-vllm-ext", "tags": ["vllm", "qwen", "qwen-vllm-ext"], "timezone": "browser",
        "schemaVersion": 39, "version": 1, "editable": True, "graphTooltip": 1, "refresh": "30s",
        "time": {"from": "now-3h", "to": "now"}, "annotations": {"list": []},
        "description": "qwen-vllm-ext replicas: tokens, billing, latency, scheduler, gateway, ledger "
                       "(built by deploy/grafana/build_dashboard.py)",
        "templating": {"list": variables()}, "panels": panels,
        "__requires": [{"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"}],
    }


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when the committed JSON differs from the build")
    args = ap.parse_args()
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run python deploy/grafana/build_dashboard.py")
            return 1
        print(f"{OUT} is current")
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT} ({len(build()['panels'])} panels)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
