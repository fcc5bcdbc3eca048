"""The metric catalog is the one source of truth: every qwen_ext_* family the code exports is catalogued, every
catalogued vLLM family exists in vLLM's source, the rules and the dashboard name only catalogued series, the
generated docs/metrics.md and the built dashboard JSON are current; the top-k families stay bounded."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from qwen_vllm_ext.observability import catalog
from qwen_vllm_ext.observability.topk import OTHER, WindowedTopK

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "qwen-vllm-ext.rules.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "qwen-vllm-ext.json"
SERIES = re.compile(r"(?<![\w:])((?:vllm:|qwen_ext_)[A-Za-z0-9_:]+)")


# ---- top-k ---------------------------------------------------------------------------------------------------
def test_top_k_keeps_the_n_largest_keys_and_sums_the_rest_under_other():
    top = WindowedTopK(n=2, window_s=60)
    for key, amount in (("a", 5), ("b", 50), ("c", 20), ("d", 1), (None, 3)):
        top.add(key, amount, now=100.0)
    assert top.top(100.0) == {"b": 50, "c": 20, OTHER: 9}


def test_top_k_forgets_what_left_the_window():
    top = WindowedTopK(n=5, window_s=60, slots=6)
    top.add("old", 100, now=0.0)
    top.add("new", 1, now=55.0)
    assert top.top(55.0) == {"old": 100, "new": 1}
    assert top.top(61.0) == {"new": 1}
    assert top.top(125.0) == {}


def test_top_k_ignores_non_positive_amounts_and_refuses_bad_sizes():
    top = WindowedTopK(n=1, window_s=1)
    top.add("a", 0, now=0.0)
    top.add("a", -3, now=0.0)
    assert top.top(0.0) == {}
    with pytest.raises(ValueError):
        WindowedTopK(n=0, window_s=1)


def test_top_k_stays_bounded_over_many_keys():
    top = WindowedTopK(n=catalog.TOP_KEYS, window_s=300)
    for i in range(5000):
        top.add(f"key-{i}", i % 97 + 1, now=float(i % 200))
    out = top.top(200.0)
    assert len(out) == catalog.TOP_KEYS + 1 and OTHER in out


# ---- catalog --------------------------------------------------------------------------------------------------
def _sources(root: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in root.rglob("*.py"))


def test_every_qwen_ext_name_in_the_code_is_catalogued_and_every_catalogued_one_is_exported():
    code = _sources(ROOT / "qwen_vllm_ext")
    named = {n for n in re.findall(r"[\"'](qwen_ext_[a-z0-9_]+)[\"']", code)}
    families = {m.name for m in catalog.METRICS if m.ours}
    assert named - families - set(catalog.by_series()) == set(), "names in the code the catalog does not know"
    catalog_src = (ROOT / "qwen_vllm_ext" / "observability" / "catalog.py").read_text()
    outside = code.replace(catalog_src, "")
    unused = {f for f in families if f'"{f}"' not in outside}
    assert unused == set(), "catalogued families nothing exports"
    # prometheus_client objects are only ever created through the catalog
    assert not re.search(r"\b(Counter|Gauge|Histogram)\(\s*[\"']qwen_ext_", code)


def test_catalogued_vllm_families_exist_in_vllm():
    """Each catalogued vLLM family is named in the vLLM module the catalog says exports it."""
    import importlib.util

    def source(module: str) -> str:
        return Path(importlib.util.find_spec(module).origin).read_text()

    missing = [(m.name, m.home) for m in catalog.METRICS if not m.ours and f'"{m.name}"' not in source(m.home)]
    assert missing == []
    assert {m.home for m in catalog.METRICS if not m.ours} == {"vllm.v1.metrics.loggers", "vllm.v1.spec_decode.metrics"}


def test_catalog_entries_are_well_formed():
    names = [m.name for m in catalog.METRICS]
    assert len(names) == len(set(names))
    for m in catalog.METRICS:
        assert m.type in ("counter", "gauge", "histogram") and m.help and m.home
        assert (m.buckets is not None) == (m.type == "histogram" and m.ours)
        assert "api_key" not in m.labels and "request_id" not in m.labels
    with pytest.raises(ValueError):
        catalog.counter("qwen_ext_ledger_queue_depth")  # a gauge
    with pytest.raises(ValueError):
        catalog.family("vllm:prompt_tokens")


def _rule_exprs() -> list[str]:
    return [r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def _dashboard_exprs() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in board["panels"] for t in p.get("targets", [])]


@pytest.mark.parametrize("where", ["rules", "dashboard"])
def test_rules_and_dashboard_name_only_catalogued_series(where):
    exprs = _rule_exprs() if where == "rules" else _dashboard_exprs()
    known = catalog.by_series()
    unknown = sorted({n for e in exprs for n in SERIES.findall(e)} - set(known))
    assert exprs and unknown == []


def test_the_dashboard_json_is_the_builders_output_and_well_formed():
    run = subprocess.run([sys.executable, str(ROOT / "deploy" / "grafana" / "build_dashboard.py"), "--check"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    board = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"model", "instance"} <= set(variables)
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for p in board["panels"]:
        assert 0 <= p["gridPos"]["x"] and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}" and p["targets"]
            assert all(t["expr"] and t["refId"] for t in p["targets"])
    titles = " ".join(p["title"].lower() for p in board["panels"])
    for wanted in ("tokens/s", "billed", "cached-token", "reuse", "first token", "per output token",
                   "end-to-end", "kv-cache", "load factor", "rejections", "overhead", "ledger", "top keys"):
        assert wanted in titles, wanted


def test_the_metrics_reference_is_current():
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "metrics_reference.py"), "--check"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    text = (ROOT / "docs" / "metrics.md").read_text()
    for m in catalog.METRICS:
        assert m.series_names()[0] in text or m.name in text
