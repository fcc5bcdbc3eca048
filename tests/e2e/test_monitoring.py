"""E2E: the shipped monitoring against a real Prometheus (Debian's package, started here on loopback with a
generated config: 2 s scrapes, 1 s rule evaluation) scraping a real demo server (gateway, SQLite ledger and the
token-weighted scheduler on).

After a short TokenStorm run that includes rate-limit and budget rejections, a bad key, a repeated prompt and a
client disconnect:
* every PromQL expression of the rules and of the dashboard evaluates without error through the HTTP API; every
  recording rule and dashboard query returns data, and every series an alert names exists (unless listed in
  QUIET with the reason this scenario cannot produce it);
* the recorded ledger drift is exactly 0 and no alert is active but the two the scenario provokes (429 share,
  insufficient quota) — the drift alerts are silent;
* series per metric stay bounded after 1,000 requests from 200 keys;
* the server runs with a metrics key (its /metrics refuses a scrape without it) and Prometheus scrapes it with the
  shipped job's ``authorization`` (deploy/prometheus/prometheus.yml, a static target instead of DNS discovery);
* records deleted from the ledger store behind the server's back make QwenExtLedgerDriftAtIdle fire, with the
  deleted tokens as its value.
"""
from __future__ import annotations

import json
import re
import shutil
import socket
import sqlite3
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from qwen_vllm_ext.demo import SERVED_NAME
from qwen_vllm_ext.usage.ledger import SqliteLedgerStore

from ..helpers.gateway import ADMIN
from ..helpers.monitoring import DASHBOARD, SELECTOR
from . import disconnects
from .servers import early, gateway_server

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "qwen-vllm-ext.rules.yml"
SCRAPE_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
METRICS_KEY = "metrics-key-for-the-monitoring-test"
IDLE_DRIFT_FOR = "10s"


def fast_idle_drift_rules(workdir: Path) -> Path:
    """The shipped rules, with QwenExtLedgerDriftAtIdle's ``for: 1m`` cut to IDLE_DRIFT_FOR: the test proves its
    expression, value and labels; waiting out the minute would only add a minute to the suite."""
    text = RULES.read_text()
    head, sep, tail = text.partition("- alert: QwenExtLedgerDriftAtIdle")
    assert sep and "for: 1m" in tail.split("- alert:", 1)[0], "QwenExtLedgerDriftAtIdle lost its for: 1m"
    out = workdir / "rules.yml"
    out.write_text(head + sep + tail.replace("for: 1m", f"for: {IDLE_DRIFT_FOR}", 1))
    return out
JOB = "qwen-replica"

QUIET = {
    # families that exist on this server but whose signal the scenario cannot produce
    "vllm:engine_sleep_state": "vLLM exports it only with --enable-sleep-mode (GPU)",
    # hybrid models only (an engine core with turn checkpoints publishes them): the monitored server is the dense
    # demo; tests/e2e/test_hybrid_demo.py reads them from the hybrid demo's /metrics
    "qwen_ext_kv_answer_state_copies_total": "hybrid models only",
    "qwen_ext_kv_answer_state_copies_skipped_total": "hybrid models only",
    # speculative decoding only: tests/e2e/test_mtp_demo.py reads them from the MTP demo's /metrics
    "vllm:spec_decode_num_drafts_total": "speculative decoding only",
    "vllm:spec_decode_num_draft_tokens_total": "speculative decoding only",
    "vllm:spec_decode_num_accepted_tokens_total": "speculative decoding only",
}
QUIET_QUERIES = {
    # recording rules / dashboard queries (by a substring) that return no data here, with the reason
    "growth_ratio_30m": "the 30 min window has not seen the engine's counters twice yet",
    "vllm:spec_decode_num_": "speculative decoding only (the MTP demo's e2e test reads these series)",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    def __init__(self, target: str, workdir: Path):
        binary = shutil.which("prometheus")
        assert binary, "prometheus missing: ./scripts/setup.sh installs Debian's prometheus package"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # the shipped job (its name and scrape credential) with a static target and the key in a file here
        job, = [j for j in yaml.safe_load(SCRAPE_CONFIG.read_text())["scrape_configs"] if j["job_name"] == JOB]
        (workdir / "qwen-metrics-key").write_text(METRICS_KEY + "\n")
        job = {**{k: v for k, v in job.items() if not k.endswith("_sd_configs")},
               "authorization": {**job["authorization"], "credentials_file": str(workdir / "qwen-metrics-key")},
               "static_configs": [{"targets": [target]}]}
        config = {
            # a scrape of a busy 2-core server can take over a second: a timed-out scrape is a gap in every series
            "global": {"scrape_interval": "2s", "evaluation_interval": "1s", "scrape_timeout": "2s"},
            "rule_files": [str(fast_idle_drift_rules(workdir))],
            "scrape_configs": [job],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = open(workdir / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if httpx.get(self.url + "/-/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None, (workdir / "prometheus.log").read_text()[-3000:]
            time.sleep(0.3)
        raise AssertionError("prometheus did not become ready")

    def query(self, expr: str) -> list:
        r = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=30)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
        return body["data"]["result"]

    def alerts(self) -> list[dict]:
        return httpx.get(self.url + "/api/v1/alerts", timeout=10).json()["data"]["alerts"]

    def rule_health(self) -> list[tuple[str, str, str]]:
        groups = httpx.get(self.url + "/api/v1/rules", timeout=10).json()["data"]["groups"]
        return [(r["name"], r["health"], r.get("lastError", "")) for g in groups for r in g["rules"]]

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def admin_key(client: httpx.Client, **fields) -> dict:
    r = client.post("/qwen_ext/admin/keys", headers={"Authorization": f"Bearer {ADMIN}"}, json=fields)
    assert r.status_code == 200, r.text
    return r.json()


def chat(client: httpx.Client, secret: str, content="hi", max_tokens=4, **extra) -> httpx.Response:
    return client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {secret}", **extra.pop("headers", {})},
                       json={"model": SERVED_NAME, "messages": [{"role": "user", "content": content}],
                             "max_tokens": max_tokens, "ignore_eos": True, **extra})


EARLY_GB = 3.5  # one server (Prometheus starts later: ~0.1)


def start_early(tmp_path_factory) -> dict:
    return {"monitored": gateway_server(tmp_path_factory, "monitored", extra=[
        "--qwen-spike-factor", "0", "--qwen-token-weighted-scheduler", "true", "--qwen-metrics-key", METRICS_KEY])}


@pytest.fixture(scope="module")
def monitored(request, tmp_path_factory):
    server = early(request, start_early)["monitored"]
    data = server.data_dir
    server.wait_healthy()
    prom = Prometheus(server.base_url.split("//", 1)[1], tmp_path_factory.mktemp("prometheus"))
    try:
        # the counters' zero samples are scraped before any traffic (increase() cannot see a first increment otherwise)
        wait_for(lambda: prom.query(f'up{{job="{JOB}"}} == 1'), 60, "the first scrape")
        yield server, data, prom
    finally:
        prom.stop()
        server.stop()


def wait_for(fn, timeout: float, what: str, every: float = 1.0):
    deadline = time.time() + timeout
    while True:
        value = fn()
        if value:
            return value
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(every)


@pytest.fixture(scope="module")
def scenario(monitored, tmp_path_factory):
    """The traffic every check below looks at (run once)."""
    server, data, prom = monitored
    out = tmp_path_factory.mktemp("storm")
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        limited = admin_key(c, name="storm", tpm=4000, rpm=1000)["key"]
        broke = admin_key(c, name="broke", daily_budget="0.000001")["key"]
        free = admin_key(c, name="free")["key"]
        # TokenStorm: multi-turn sessions (repeated prefixes, conversation ids) under a TPM limit that denies part
        proc = subprocess.run([sys.executable, "-m", "qwen_vllm_ext.bench.token_storm", "--base-url", server.base_url,
                               "--model", SERVED_NAME, "--api-key", limited, "--ledger", str(data / "ledger.sqlite3"),
                               "--output-dir", str(out), "--no-progress", "--no-plot", "--distribution", "normal",
                               "--input-len", "120", "--output-len", "12", "--turns", "3", "--rate", "4",
                               "--num-requests", "45", "--duration", "15", "--seed", "3"],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        report = json.loads((out / "token_storm.json").read_text())
        assert "429 rate_limit_exceeded" in report["errors"], report["errors"]
        # a repeated prompt (the prefix cache serves the second)
        prompt = "the same long question " * 40
        for _ in range(2):
            r = chat(c, free, prompt, max_tokens=2)
            assert r.status_code == 200, r.text
        # a budget that is used up, and a key that does not exist
        statuses = {chat(c, broke).status_code for _ in range(3)}
        assert 429 in statuses
        assert chat(c, "qve-not-a-key").status_code == 401
        # a client that disconnects mid-stream; another when this one was starved until the engine had finished
        # (tests/e2e/disconnects.py)
        store = SqliteLedgerStore(str(data / "ledger.sqlite3"))
        for attempt in range(disconnects.ATTEMPTS):
            rid = f"monitoring-disconnect-{attempt}"
            with c.stream("POST", "/v1/chat/completions",
                          headers={"Authorization": f"Bearer {free}", "X-Request-ID": rid},
                          json={"model": SERVED_NAME, "messages": [{"role": "user", "content": "go on"}],
                                "max_tokens": disconnects.MAX_TOKENS, "ignore_eos": True, "stream": True}) as r:
                assert r.status_code == 200
                for _ in r.iter_lines():
                    break
            closed_at = time.time()
            record = wait_for(lambda: store.get(rid), 60, "the disconnected request's ledger record", every=0.2)
            if disconnects.recorded(record, closed_at):
                break
        else:
            pytest.fail("no disconnect recorded: every client was too late (the machine starved the test client)")
    # Prometheus sees the record
    wait_for(lambda: prom.query('qwen_ext_ledger_records_total{status="client_disconnected"} > 0'), 120,
             "the disconnected request's ledger record")
    # the ledger has every record and the engine is idle; two refreshes of the ledger gauge and some scrapes later
    time.sleep(12)
    return report


def _rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def _dashboard_queries() -> list[tuple[str, str]]:
    board = json.loads(DASHBOARD.read_text())
    subst = {"$model": ".*", "$instance": ".*", "$__rate_interval": "2m"}
    out = []
    for p in board["panels"]:
        for t in p.get("targets", []):
            expr = t["expr"]
            for k, v in subst.items():
                expr = expr.replace(k, v)
            out.append((p["title"], expr))
    return out


def _quiet(expr: str) -> str | None:
    return next((reason for marker, reason in QUIET_QUERIES.items() if marker in expr), None)


def test_every_rule_evaluates_without_error(monitored, scenario):
    _, _, prom = monitored
    health = wait_for(lambda: (h := prom.rule_health()) and all(x[1] != "unknown" for x in h) and h, 30,
                      "every rule evaluated once")
    bad = [h for h in health if h[1] != "ok"]
    assert bad == [], bad
    assert len(health) == len(_rules())


def test_every_recording_rule_and_dashboard_query_returns_data(monitored, scenario):
    _, _, prom = monitored
    empty = []
    for rule in _rules():
        if "record" in rule:
            if prom.query(rule["record"]) == [] and not _quiet(rule["record"]):
                empty.append(("rule", rule["record"]))
        else:
            prom.query(rule["expr"])  # evaluates (raises on an error); empty is normal: nothing is wrong
    for title, expr in _dashboard_queries():
        result = prom.query(expr)
        if not result and not _quiet(expr):
            empty.append((title, expr))
    assert empty == [], empty


def test_every_series_a_rule_or_panel_names_is_exported(monitored, scenario):
    """A panel or rule naming a metric the server does not export fails here (label matchers included)."""
    _, _, prom = monitored
    exprs = [r["expr"] for r in _rules()] + [e for _, e in _dashboard_queries()]
    selectors = {(m.group(1), m.group(2) or "") for e in exprs for m in SELECTOR.finditer(e)}
    names = set(httpx.get(prom.url + "/api/v1/label/__name__/values", timeout=10).json()["data"])
    missing = sorted(f"{n}{sel}" for n, sel in selectors
                     if n not in QUIET and (n not in names or (sel and not prom.query(f"{n}{sel}".replace(
                         '"$model"', '".*"').replace('"$instance"', '".*"')))))
    assert missing == [], missing
    assert prom.query(f'up{{job="{JOB}"}} == 1')


PROVOKED = {"QwenExtRateLimitedShareHigh": "pending", "QwenExtInsufficientQuota": "firing"}
"""The alerts the scenario provokes on purpose (a third of the storm is rate limited, a key's budget is used up); only
these may be active after it."""


def test_a_clean_run_has_zero_drift_and_only_the_provoked_alerts(monitored, scenario):
    server, data, prom = monitored
    drift = wait_for(lambda: prom.query("instance:qwen_ext_ledger_token_drift:tokens"), 20, "the drift series")
    assert float(drift[0]["value"][1]) == 0, drift
    assert float(prom.query("instance:vllm_requests_in_engine:sum")[0]["value"][1]) == 0
    # the same figures as `usage reconcile` and the ledger store
    from qwen_vllm_ext.usage.ledger import SqliteLedgerStore

    instance = httpx.get(server.base_url + "/qwen_ext/health", timeout=10,
                         headers={"Authorization": f"Bearer {ADMIN}"}).json()["instance_id"]
    totals = SqliteLedgerStore(str(data / "ledger.sqlite3")).instance_tokens(instance)
    exported = {s["metric"]["kind"]: float(s["value"][1]) for s in prom.query("qwen_ext_ledger_instance_tokens")}
    assert exported == {"engine_prompt": totals["engine_prompt_tokens"], "completion": totals["completion_tokens"]}
    active = {a["labels"]["alertname"]: a["state"] for a in prom.alerts()}
    assert set(active) <= set(PROVOKED), active
    # what provokes them is there: the budget refusals are counted and the 429 share is over the alert's 5 %
    assert prom.query('increase(qwen_ext_gateway_rejections_total{code="insufficient_quota"}[15m]) > 0')
    assert prom.query('sum(rate(qwen_ext_gateway_rejections_total{code="rate_limit_exceeded"}[5m])) / '
                      '(sum(rate(qwen_ext_gateway_admissions_total[5m])) + '
                      'sum(rate(qwen_ext_gateway_rejections_total[5m]))) > 0.05')


def test_rejections_and_top_keys_are_exported_by_code(monitored, scenario):
    _, _, prom = monitored
    by_code = {(s["metric"]["code"], s["metric"]["http_status"])
               for s in prom.query("qwen_ext_gateway_rejections_total")}
    assert {("rate_limit_exceeded", "429"), ("insufficient_quota", "429"), ("invalid_api_key", "401")} <= by_code
    assert prom.query("qwen_ext_gateway_admissions_total > 0")
    assert prom.query('qwen_ext_store_up{store="limiter"} == 1') and prom.query('qwen_ext_store_up{store="ledger"} == 1')
    assert prom.query("qwen_ext_top_key_tokens > 0") and prom.query("qwen_ext_top_key_rejections > 0")
    assert prom.query('qwen_ext_ledger_records_total{status="client_disconnected"} > 0')
    assert prom.query("qwen_ext_runtime_patch_active == 1") and not prom.query("qwen_ext_runtime_patch_active == 0")


def test_series_stay_bounded_after_400_requests_from_200_keys(monitored, scenario):
    """The series' count follows the label values (200 keys, each seen twice), not the request count."""
    server, _, _ = monitored
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        secrets = [admin_key(c, name=f"many-{i}")["key"] for i in range(200)]

    def one(i):
        with httpx.Client(base_url=server.base_url, timeout=300) as c:
            return chat(c, secrets[i % 200], f"request {i}", max_tokens=1).status_code

    with ThreadPoolExecutor(16) as pool:
        codes = list(pool.map(one, range(400)))
    assert codes.count(200) == 400
    refused = httpx.get(server.base_url + "/metrics", timeout=30)  # the per-key series need the metrics key
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_metrics_key", refused.text
    text = httpx.get(server.base_url + "/metrics", headers={"Authorization": f"Bearer {METRICS_KEY}"}, timeout=30).text
    per_family: dict[str, int] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = re.match(r"[A-Za-z_:][\w:]*", line).group(0)
            family = re.sub(r"_(total|bucket|sum|count|created)$", "", name)
            per_family[family] = per_family.get(family, 0) + 1
    ours = {f: n for f, n in per_family.items() if f.startswith("qwen_ext_")}
    assert ours and max(ours.values()) <= 60, sorted(ours.items(), key=lambda kv: -kv[1])[:5]
    assert per_family["qwen_ext_top_key_tokens"] <= 11
    assert max(per_family.values()) <= 200, sorted(per_family.items(), key=lambda kv: -kv[1])[:5]
    assert sum(ours.values()) <= 400


def test_the_idle_drift_alert_fires_when_records_vanish_from_the_store(monitored, scenario):
    """Last in the module: it damages the ledger."""
    server, data, prom = monitored
    time.sleep(8)  # the previous test's requests are all recorded and the gauge refreshed
    assert float(wait_for(lambda: prom.query("instance:qwen_ext_ledger_token_drift:tokens"), 20,
                          "drift")[0]["value"][1]) == 0
    with sqlite3.connect(data / "ledger.sqlite3") as db:
        rows = db.execute("SELECT request_id, engine_prompt_tokens + completion_tokens FROM requests "
                          "WHERE engine_prompt_tokens > 0 ORDER BY finished_at DESC LIMIT 3").fetchall()
        assert len(rows) == 3
        db.executemany("DELETE FROM requests WHERE request_id = ?", [(r,) for r, _ in rows])
    lost = sum(n for _, n in rows)

    def firing():
        return [a for a in prom.alerts() if a["labels"]["alertname"] == "QwenExtLedgerDriftAtIdle"
                and a["state"] == "firing"]

    alerts = wait_for(firing, 120, "QwenExtLedgerDriftAtIdle firing", every=2)
    assert float(alerts[0]["value"]) == lost
    assert alerts[0]["labels"]["severity"] == "critical" and alerts[0]["labels"]["job"] == JOB
