"""Compare the ledger with vLLM's own Prometheus counters for one running server (pure Python + urllib).

vLLM counts ``vllm:prompt_tokens_total`` (prompt tokens once prefilled) and ``vllm:generation_tokens_total``
since the server started. The ledger records, per request, the same engine counts; summed over the server's
instance id they must be equal. A drift means lost or double-counted records (or traffic on endpoints the
ledger does not track).
"""
from __future__ import annotations

import json
import re
import urllib.request

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\})?\s+'
                     r'([0-9.eE+-]+|NaN|[+-]Inf)(?:\s+-?\d+)?\s*$')
COUNTERS = {"prompt_tokens": "vllm:prompt_tokens_total", "completion_tokens": "vllm:generation_tokens_total"}


def parse_counters(text: str, names) -> dict[str, float]:
    """Sum of every sample of each metric name (all label sets) in Prometheus text format."""
    sums = {name: 0.0 for name in names}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line.strip())
        if m and m.group(1) in sums:
            value = float(m.group(3))
            if value == value:  # a NaN sample carries no count
                sums[m.group(1)] += value
    return sums


def fetch(url: str, path: str, timeout: float = 10.0, token: str | None = None) -> str:
    """GET ``url + path`` (with ``Authorization: Bearer <token>`` when given: the admin key shows the health route's
    details -- instance id, settings -- when the gateway is on)."""
    request = urllib.request.Request(url.rstrip("/") + path,
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        return resp.read().decode("utf-8")


def drift(server_counts: dict[str, float], ledger_totals: dict) -> dict[str, int]:
    """server - ledger, per counter (prompt: the ledger's engine_prompt_tokens)."""
    return {
        "prompt_tokens": int(server_counts[COUNTERS["prompt_tokens"]]) - int(ledger_totals["engine_prompt_tokens"]),
        "completion_tokens": int(server_counts[COUNTERS["completion_tokens"]]) - int(ledger_totals["completion_tokens"]),
    }


def reconcile(url: str, store, admin_key: str | None = None) -> dict:
    """Fetch the server's counters and instance id, sum the ledger for that instance, report the drift (with the
    gateway on, the instance id needs the admin key)."""
    health = json.loads(fetch(url, "/qwen_ext/health", token=admin_key))
    if "instance_id" not in health:
        raise ValueError("the server shows its instance id only to the admin when the gateway is on: pass --admin-key "
                         "or set QWEN_VLLM_EXT_ADMIN_KEY")
    server = parse_counters(fetch(url, "/metrics", token=admin_key), COUNTERS.values())
    totals = store.totals(instance_id=health["instance_id"])
    return {"instance_id": health["instance_id"], "server": server, "ledger": totals, "drift": drift(server, totals)}
