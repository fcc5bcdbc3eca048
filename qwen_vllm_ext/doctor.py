"""``python -m qwen_vllm_ext.doctor --url http://HOST:PORT [--api-key K] [--admin-key A] [--json]``

Checks a running server from the outside, as an operator would after a deploy, and prints one line per check —
PASS / WARN / FAIL, what was seen, what to do — (``--json``: the same as a list of objects). Exit status 1 on any
FAIL. Needs only the standard library and ``httpx``.

Every probe request carries an ``x-request-id`` starting with ``qwen-doctor-``: the ledger keeps it as the record's
id, counts it in the instance totals (the engine did the work) but not in the daily aggregates, and ``usage report``
leaves probes out unless ``--include-probes``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import uuid
from collections.abc import Callable

from .usage.ledger import PROBE_PREFIX

REUSE_MIN = 0.9
BLOCK_FALLBACK = 16


@dataclasses.dataclass
class Check:
    name: str
    status: str  # PASS, WARN, FAIL
    seen: str
    fix: str = ""


class Doctor:
    def __init__(self, url: str, api_key: str | None = None, admin_key: str | None = None, timeout: float = 120.0):
        import httpx

        self.url = url.rstrip("/")
        self.api_key, self.admin_key = api_key, admin_key
        self.http = httpx.Client(base_url=self.url, timeout=timeout)
        self.checks: list[Check] = []
        self.health: dict | None = None
        self.model: str | None = None
        self.metrics_text = ""
        self.probe_usage: dict | None = None  # the final usage of the first probe stream
        self.key_unusable = False  # the --api-key was refused (suspended, revoked, out of scope): probes skipped

    # ---- helpers ---------------------------------------------------------------------------------------------
    def add(self, name: str, status: str, seen: str, fix: str = "") -> Check:
        check = Check(name, status, seen, fix if status != "PASS" else "")
        self.checks.append(check)
        return check

    def headers(self, extra: dict | None = None) -> dict:
        h = {"x-request-id": PROBE_PREFIX + uuid.uuid4().hex[:16]}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return {**h, **(extra or {})}

    def admin_headers(self) -> dict:
        """The admin key, for the health route's details (settings, launch record) when the gateway is on."""
        return {"Authorization": f"Bearer {self.admin_key}"} if self.admin_key else {}

    def settings(self) -> dict:
        return (self.health or {}).get("settings", {})

    def chat_stream(self, messages: list[dict], max_tokens: int = 8, headers: dict | None = None) -> dict:
        """Stream one chat completion; returns {status, chunks, usage (last), text, headers, request_id}."""
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "stream": True,
                "temperature": 0}
        hdrs = self.headers(headers)
        out = {"status": None, "chunks": [], "usage": None, "text": "", "headers": {}, "request_id": hdrs["x-request-id"]}
        with self.http.stream("POST", "/v1/chat/completions", json=body, headers=hdrs) as r:
            out["status"], out["headers"] = r.status_code, dict(r.headers)
            if r.status_code != 200:
                out["error"] = r.read().decode(errors="replace")[:300]
                return out
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                out["chunks"].append(chunk)
                if chunk.get("usage"):
                    out["usage"] = chunk["usage"]
                for choice in chunk.get("choices") or []:
                    out["text"] += (choice.get("delta") or {}).get("content") or ""
        return out

    def metric_sum(self, name: str) -> float | None:
        """Sum of a metric's samples on the last /metrics (None when it has no sample there)."""
        from .usage.reconcile import parse_counters

        sampled = any(line.startswith((name + "{", name + " ")) for line in self.metrics_text.splitlines())
        return parse_counters(self.metrics_text, [name])[name] if sampled else None

    def cache_config(self) -> dict[str, str] | None:
        """The labels of ``vllm:cache_config_info`` on the last /metrics (None when absent)."""
        import re

        line = next((x for x in self.metrics_text.splitlines() if x.startswith("vllm:cache_config_info{")), None)
        return None if line is None else dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', line))

    def refresh_metrics(self) -> None:
        # with the metrics_key setting, /metrics also answers the admin key (the per-key series need one of them)
        r = self.http.get("/metrics", headers={"Authorization": f"Bearer {self.admin_key}"} if self.admin_key else None)
        self.metrics_text = r.text if r.status_code == 200 else ""

    # ---- checks ----------------------------------------------------------------------------------------------
    def run(self) -> list[Check]:
        # the scheduler is checked after the probes: an engine core publishes its status once it has scheduled
        steps: list[Callable[[], bool | None]] = [self.check_reachable, self.check_plugin, self.check_versions,
                                                 self.check_prefix_caching, self.check_hardware, self.check_key,
                                                 self.check_probe, self.check_reuse, self.check_scheduler,
                                                 self.check_gateway, self.check_admin, self.check_openrouter,
                                                 self.check_ledger]
        for step in steps:
            if self.key_unusable and step in (self.check_probe, self.check_reuse, self.check_scheduler,
                                              self.check_openrouter):
                continue  # the key check said why (a suspended or refused key): not three misleading FAILs more
            try:
                if step() is False:
                    break  # nothing further can be checked
            except Exception as exc:  # noqa: BLE001 - a check that crashes is a FAIL with its reason
                self.add(step.__name__.removeprefix("check_"), "FAIL", f"{type(exc).__name__}: {exc}",
                         "see the server log; rerun with --json for details")
        return self.checks

    def check_reachable(self) -> bool:
        try:
            r = self.http.get("/health", timeout=10)
        except Exception as exc:  # noqa: BLE001
            self.add("server", "FAIL", f"{self.url} unreachable ({exc})", "check the URL, the port and the pod")
            return False
        if r.status_code != 200:
            self.add("server", "FAIL", f"/health answered {r.status_code}", "the engine is not ready: see the log")
            return False
        models = self.http.get("/v1/models", headers=self.headers())
        if models.status_code != 200:
            problem = self.key_problem(models) if self.api_key else None
            if problem is None:
                self.add("server", "FAIL", f"/v1/models answered {models.status_code}",
                         "the gateway is on: pass --api-key with a key for this server")
                return False
            self.add("server", "PASS", f"/health 200; /v1/models refused the --api-key ({models.status_code})")
            self.add("api key", "FAIL", *problem)
            self.key_unusable = True  # the checks that need the key are skipped; the rest still run
            return True
        self.model = (models.json().get("data") or [{}])[0].get("id")
        self.add("server", "PASS", f"/health 200; serving {self.model}")
        return True

    def check_plugin(self) -> bool:
        r = self.http.get("/qwen_ext/health", timeout=10, headers=self.admin_headers())
        if r.status_code != 200:
            self.add("plugin", "FAIL", f"/qwen_ext/health answered {r.status_code}: the extension's endpoint plugin "
                     "is not loaded in the API server",
                     "start with `python -m qwen_vllm_ext.serve`, or add qwen_vllm_ext to VLLM_PLUGINS "
                     "(vLLM loads endpoint plugins only when named there)")
            return False
        self.health = h = r.json()
        roles = set(h.get("plugin_loaded_in", []))
        if not {"api_server", "engine_core"} <= roles:
            self.add("plugin", "FAIL", f"loaded in {sorted(roles)}; the engine core is missing",
                     "VLLM_PLUGINS must not filter out qwen_vllm_ext (the engine core loads general plugins)")
        else:
            self.add("plugin", "PASS", f"loaded in {', '.join(sorted(roles))}")
        return True

    def check_versions(self) -> None:
        from .integration.vllm_version import SUPPORTED_VLLM_SERIES, version_supported

        h = self.health
        vllm = h.get("vllm_version", "?")
        if not version_supported(vllm):
            self.add("vllm version", "FAIL", f"vLLM {vllm}; supported series {', '.join(SUPPORTED_VLLM_SERIES)}",
                     "install a supported vLLM or the extension release built for this one")
        else:
            self.add("vllm version", "PASS", f"vLLM {vllm}, extension {h.get('version')}")
        disabled = h.get("disabled_patches") or {}
        if not h.get("patching"):
            self.add("runtime patches", "FAIL", f"patching off: {h.get('patching_reason')}",
                     "see the reason; enabled=true and a supported vLLM turn them on")
        elif disabled:
            self.add("runtime patches", "FAIL", f"disabled by the compatibility guard: {', '.join(disabled)}",
                     "vLLM changed under the patch: install the matching extension release or pin vLLM")
        else:
            self.add("runtime patches", "PASS", f"active: {', '.join(h['features']['patches']) or 'none wanted'} "
                     f"({h.get('patch_mode')} mode)")

    def check_scheduler(self) -> None:
        status = self.http.get("/qwen_ext/health", timeout=10, headers=self.admin_headers()).json().get("scheduler") or []
        mode = self.settings().get("token_weighted_scheduler")
        mode = {True: "true", False: "false", None: "false"}.get(mode, mode)  # older servers: a boolean
        if status:
            s = status[0]
            gate = s.get("gate")
            gated = (f"; overload gate {'on' if gate.get('overloaded') else 'off'} (backlog {gate.get('backlog_steps')} "
                     f"steps, {gate.get('switches')} switches)") if gate else ""
            self.add("scheduler", "PASS", f"{s.get('scheduler')} in the engine core (pid {s.get('pid')}, mode "
                     f"{s.get('mode', 'true')}); ordering: {(s.get('costs') or {}).get('ordering', '?')}{gated}")
        elif mode != "false":
            self.add("scheduler", "FAIL", f"token_weighted_scheduler={mode} but no engine core reports the class",
                     "an explicit --scheduler-cls wins over the setting; check the engine core log")
        else:
            self.add("scheduler", "PASS", "vLLM's FCFS scheduler (token_weighted_scheduler=false: the cpu profile's "
                     "default; docs/scheduling.md says when to turn it on)")

    def check_prefix_caching(self) -> None:
        self.refresh_metrics()
        info = self.cache_config()
        if info is None:
            self.add("prefix caching", "WARN", "vllm:cache_config_info not on /metrics", "check --disable-log-stats")
            return
        if info.get("enable_prefix_caching") == "True":
            self.add("prefix caching", "PASS", "enable_prefix_caching=True (vllm:cache_config_info)")
        else:
            self.add("prefix caching", "FAIL", "enable_prefix_caching=False: no cached tokens, no KV reuse across turns",
                     "drop --no-enable-prefix-caching (the profiles turn it on)")

    def check_hardware(self) -> None:
        """The launcher's profile against the GPUs it saw (health route ``launch``), and the field report's traps
        visible from outside (the KV-cache dtype on ``vllm:cache_config_info``)."""
        launch = self.health.get("launch")
        dtype = (self.cache_config() or {}).get("cache_dtype", "auto")
        if dtype != "auto":
            self.add("kv-cache dtype", "WARN", f"cache_dtype={dtype}", "the field report's fp16 override only adds a "
                     "conversion for bf16 checkpoints; drop --kv-cache-dtype unless memory needs fp8")
        if "details" in self.health:  # the gateway is on and no (valid) admin key was given: the launch record is hidden
            self.add("profile vs hardware", "WARN", "the launch record is shown only to the admin (gateway on)",
                     "rerun with --admin-key (or QWEN_VLLM_EXT_ADMIN_KEY) to check the profile against the hardware")
            return
        if not launch:
            self.add("profile vs hardware", "WARN", "not started by the launcher: no tuned profile, hardware unseen",
                     "start with `python -m qwen_vllm_ext.serve` (it picks the profile for the GPU)")
            return
        gpus, profile = launch.get("gpus") or [], launch.get("profile")
        where = ", ".join(f"{g['name']} ({g['memory_gib']:.0f} GiB{', MIG' if g['mig_enabled'] else ''})"
                          for g in gpus) or "no GPU"
        seen = f"profile {profile} on {where}"
        if launch.get("device") == "cpu" and gpus:
            self.add("profile vs hardware", "FAIL", seen, "a GPU is there: drop --profile cpu (or pass the GPU's)")
        elif launch.get("device") != "cpu" and not gpus:
            self.add("profile vs hardware", "FAIL", seen, "a GPU profile without a visible GPU: check the device plugin")
        elif any(g["memory_gib"] < launch.get("min_gpu_memory_gib", 0) for g in gpus):
            self.add("profile vs hardware", "FAIL", seen + f"; the profile needs {launch['min_gpu_memory_gib']} GiB",
                     "pick the profile of this GPU (`python -m qwen_vllm_ext.serve --list-profiles`)")
        elif any(g["mig_enabled"] for g in gpus):
            self.add("profile vs hardware", "WARN", seen, "MIG is on: a slice has a fraction of the memory the "
                     "profile is sized for; lower --gpu-memory-utilization/--max-num-seqs or disable MIG")
        else:
            self.add("profile vs hardware", "PASS", seen)

    def key_problem(self, r) -> tuple[str, str] | None:
        """(what was seen, the fix) when response ``r`` refused the --api-key itself (suspended, revoked, expired,
        out of scope), else None. A suspended key is reported as suspended, with the time it lifts and the command
        that lifts it now."""
        error = (r.json().get("error") or {}) if r.headers.get("content-type", "").startswith("application/json") \
            else {}
        code = error.get("code")
        if code == "api_key_suspended":
            return (f"the key is suspended: {error.get('message')}",
                    "lift it now with `python -m qwen_vllm_ext.keys update KEY_ID --unsuspend` (KEY_ID: "
                    "`python -m qwen_vllm_ext.keys list`), or PATCH /qwen_ext/admin/keys/KEY_ID with "
                    "{\"suspended_until\": null}; create an aggregator's key with --no-spike-breaker")
        if code in ("invalid_api_key", "api_key_expired"):
            return (f"HTTP {r.status_code} {code}: {error.get('message')}",
                    "pass a current key: `python -m qwen_vllm_ext.keys create --name NAME`")
        if code == "model_not_allowed":
            return (f"HTTP {r.status_code} {code}: {error.get('message')}",
                    f"allow the key on {self.model}: `python -m qwen_vllm_ext.keys update KEY_ID --all-models`")
        return None

    def check_key(self) -> None:
        """With the gateway on and --api-key given (and not already refused at /v1/models): the key can be used; the
        probes that need it are skipped when it cannot."""
        if not (self.api_key and self.settings().get("gateway")) or self.key_unusable:
            return
        r = self.http.post("/v1/chat/completions", headers=self.headers(), json={
            "model": self.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        if r.status_code == 200:
            self.add("api key", "PASS", "the --api-key is active and allowed on " + str(self.model))
            return
        problem = self.key_problem(r)
        if problem is None:  # not the key: the probes say more
            self.add("api key", "WARN", f"a one-token request got HTTP {r.status_code}", "see the probes below")
            return
        self.key_unusable = True
        self.add("api key", "FAIL", *problem)

    def check_probe(self) -> None:
        messages = [{"role": "user", "content": "qwen-vllm-ext doctor probe: "
                     + " ".join(f"word{i}" for i in range(200))}]
        first = self.chat_stream(messages)
        if first["status"] != 200:
            self.add("probe request", "FAIL", f"HTTP {first['status']}: {first.get('error')}",
                     "pass --api-key with a key allowed on this model (gateway on)")
            return
        content = [c for c in first["chunks"] if c.get("choices")]
        missing = [i for i, c in enumerate(content) if not c.get("usage")]
        final = first["usage"] or {}
        self.probe_usage = final
        if missing or "billing" not in final or "cached_tokens" not in (final.get("prompt_tokens_details") or {}):
            self.add("usage on every chunk", "FAIL", f"{len(missing)} of {len(content)} chunks without usage; "
                     f"final usage keys {sorted(final)}", "per_chunk_usage=true (default) and the runtime patch active")
        else:
            self.add("usage on every chunk", "PASS", f"{len(content)} chunks, each with usage (cached tokens, "
                     f"billing); prompt {final['prompt_tokens']} tokens")
        second = self.chat_stream(messages)
        cached = ((second["usage"] or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        if cached > 0:
            self.add("cached tokens", "PASS", f"the repeated probe reported {cached} cached tokens")
        else:
            self.add("cached tokens", "FAIL", "the repeated probe reported 0 cached tokens",
                     "enable prefix caching (--enable-prefix-caching; the profiles turn it on)")
        r = self.http.post("/v1/tokens/count", json={"model": self.model, "messages": messages},
                           headers=self.headers())
        counted = r.json().get("prompt_tokens") if r.status_code == 200 else None
        if counted == final.get("prompt_tokens"):
            self.add("token count", "PASS", f"POST /v1/tokens/count = served prompt_tokens = {counted}")
        else:
            self.add("token count", "FAIL", f"POST /v1/tokens/count {r.status_code} {counted} vs served "
                     f"{final.get('prompt_tokens')}", "the calculator's template differs from the served one: "
                     "check --chat-template / kv_reuse_template")

    def check_reuse(self) -> None:
        kv = self.health.get("kv_reuse") or {}
        block = int((self.cache_config() or {}).get("block_size") or BLOCK_FALLBACK)
        session = {"x-session-id": f"{PROBE_PREFIX}{uuid.uuid4().hex[:8]}"}
        messages = [{"role": "user", "content": "Turn one of a doctor probe conversation. "
                     + " ".join(f"alpha{i}" for i in range(150))}]
        ratios, prev = [], None
        for turn in range(3):
            res = self.chat_stream(messages, max_tokens=8, headers=session)
            if res["status"] != 200:
                self.add("kv reuse", "FAIL", f"turn {turn + 1}: HTTP {res['status']}", "see the probe request check")
                return
            usage = res["usage"] or {}
            if prev is not None:
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                reusable = (prev // block) * block
                ratios.append(cached / reusable if reusable else 1.0)
            # the previous turn's prompt: its completion comes back as text, which a random or truncated answer
            # need not re-tokenize to the same ids (the block holding it may miss; a real chat's answers do match)
            prev = usage.get("prompt_tokens", 0)
            messages += [{"role": "assistant", "content": res["text"]},
                         {"role": "user", "content": f"Turn {turn + 2}: go on. " + " ".join(
                             f"beta{turn}x{i}" for i in range(40))}]
        worst = min(ratios)
        template = kv.get("template")
        seen = (f"turns 2-3 reused {', '.join(f'{r:.0%}' for r in ratios)} of the previous turn's prompt "
                f"(block-rounded, block {block}); template {template}")
        fix_template = ("kv_reuse_template=true (the launcher's default) serves Qwen3 and Qwen3.5/3.6 with the "
                        "prefix-stable qwen3-reuse / qwen3.5-reuse template; the stock one drops earlier turns' "
                        "thinking, so those turns re-prefill")
        if worst < REUSE_MIN:
            self.add("kv reuse", "FAIL", seen, fix_template if not kv.get("reuse_template") else
                     "cache pressure (KV-cache usage) or a template that rewrites earlier turns")
        elif not kv.get("reuse_template") and kv.get("reuse_template_applies") is False:
            # a model none of the package's templates is for (e.g. Qwen2.5, a fine-tune with its own template)
            self.add("kv reuse", "PASS", f"{seen}; the prefix-stable templates do not apply "
                     f"({kv.get('reuse_template_note')})")
        elif not kv.get("reuse_template"):
            self.add("kv reuse", "WARN", seen + "; the prefix-stable template is off", fix_template)
        else:
            self.add("kv reuse", "PASS", seen)

    def check_gateway(self) -> None:
        if not self.settings().get("gateway"):
            self.add("gateway", "WARN", "gateway off: no API keys, no RPM/TPM limits, no budgets on this server",
                     "gateway=true (--qwen-gateway true) with keys from `python -m qwen_vllm_ext.keys create`, or "
                     "keep an external gateway in front")
            return
        bad = self.http.post("/v1/chat/completions", headers={"Authorization": "Bearer qve-doctor-invalid-key"},
                             json={"model": self.model, "messages": [{"role": "user", "content": "hi"}]})
        code = (bad.json().get("error") or {}).get("code") if bad.headers.get("content-type", "").startswith(
            "application/json") else None
        if bad.status_code == 401 and code == "invalid_api_key":
            self.add("gateway: bad key", "PASS", "a wrong key gets 401 invalid_api_key")
        else:
            self.add("gateway: bad key", "FAIL", f"a wrong key got {bad.status_code} {code}", "check the gateway log")
        if not self.api_key:
            self.add("gateway: limits", "WARN", "no --api-key given: rate-limit headers and body checks not probed",
                     "rerun with --api-key")
            return
        if self.key_unusable:
            return  # "api key" above says why
        res = self.http.post("/v1/chat/completions", headers=self.headers(), json={
            "model": self.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        limits = sorted(k for k in res.headers if k.startswith("x-ratelimit-"))
        if res.status_code == 200 and limits:
            self.add("gateway: limits", "PASS", f"{len(limits)} rate-limit headers ({', '.join(limits[:2])}, ...)")
        elif res.status_code == 200:  # docs/gateway.md: the headers come with a limit; a key without any has none
            self.add("gateway: limits", "PASS", "this key has no RPM/TPM limit, and the server none "
                     "(global_rpm/global_tpm): no x-ratelimit-* headers, as documented")
        else:
            self.add("gateway: limits", "FAIL", f"the probe got HTTP {res.status_code}", "see the 'api key' check")
        badbody = self.http.post("/v1/chat/completions", headers=self.headers(), json={
            "model": self.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -5})
        if badbody.status_code == 400:
            self.add("gateway: body checks", "PASS", "an invalid max_tokens gets 400 before the engine")
        else:
            self.add("gateway: body checks", "FAIL", f"an invalid max_tokens got {badbody.status_code}",
                     "check the gateway's admission log")

    def check_openrouter(self) -> None:
        """openrouter=true: the listing (both formats) against the server's settings and engine, the usage fields of a
        live response against the listing's prices, and the two settings the aggregator's guide asks for."""
        import re
        from decimal import Decimal

        settings = self.settings()
        if not settings.get("openrouter"):
            return
        engine = {m.get("id"): m for m in self.http.get("/v1/models", headers=self.headers()).json().get("data", [])}
        problems, entries = [], {}
        for fmt in ("openrouter", "openrouter-legacy"):
            r = self.http.get("/v1/models", params={"format": fmt}, headers=self.headers())
            data = r.json().get("data") if r.status_code == 200 else None
            entry = next((m for m in data or [] if m.get("id") == self.model), None)
            if entry is None:
                problems.append(f"{fmt}: HTTP {r.status_code}, {self.model} not listed")
            entries[fmt] = entry or {}
        legacy, current = entries["openrouter-legacy"], entries["openrouter"]
        pricing = legacy.get("pricing") or {}
        for name, value in [*pricing.items(), *((p.get("type"), p.get("cost_usd")) for m in
                                                (*current.get("input_modalities", []),
                                                 *current.get("output_modalities", []), current)
                                                for p in m.get("pricing", []))]:
            if not isinstance(value, str) or not re.match(r"^\d+(\.\d+)?$", value):
                problems.append(f"price {name}={value!r} is not a plain decimal string")
        hidden = "details" in (self.health or {})  # gateway on, no admin key: only the on/off settings are shown
        for listed, setting in (() if hidden else (("prompt", "price_prompt"), ("completion", "price_completion"))):
            want = Decimal(settings.get(setting) or "0") / 10**6
            if listed in pricing and Decimal(pricing[listed]) != want:
                problems.append(f"listed {listed} {pricing[listed]} != setting {setting} {settings.get(setting)}/M")
        max_len = (engine.get(self.model) or {}).get("max_model_len")
        if legacy and max_len and legacy.get("context_length", 0) > max_len:
            problems.append(f"listed context_length {legacy.get('context_length')} > the engine's {max_len}")
        if problems:
            self.add("openrouter: listing", "FAIL", "; ".join(problems[:3]),
                     "see GET /v1/models?format=openrouter and the price_* / listing_* settings")
            return
        self.add("openrouter: listing", "PASS", f"both formats list {self.model}: prompt {pricing.get('prompt')}, "
                 f"completion {pricing.get('completion')}, cache read {pricing.get('input_cache_read')} USD/token, "
                 f"context {legacy.get('context_length')}, {legacy.get('quantization')}")
        usage = self.probe_usage or {}
        missing = [f for f, ok in (("prompt_tokens_details.cached_tokens",
                                    "cached_tokens" in (usage.get("prompt_tokens_details") or {})),
                                   ("completion_tokens_details.reasoning_tokens",
                                    "reasoning_tokens" in (usage.get("completion_tokens_details") or {})
                                    or "reasoning" not in legacy.get("supported_features", [])),
                                   ("cost", "cost" in usage)) if not ok]
        if missing or not usage:
            self.add("openrouter: usage", "FAIL", f"the probe's final usage lacks {', '.join(missing) or 'usage'}",
                     "per_chunk_usage=true and prices set (the launcher adds --enable-prompt-tokens-details)")
        else:
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            uncached = usage["prompt_tokens"] - cached
            expected = (uncached * Decimal(pricing["prompt"]) + cached * Decimal(pricing["input_cache_read"])
                        + usage["completion_tokens"] * Decimal(pricing["completion"]) + Decimal(pricing["request"]))
            if Decimal(repr(usage["cost"])) == expected:
                self.add("openrouter: usage", "PASS", f"final usage carries cached and reasoning tokens and cost "
                         f"{usage['cost']} USD = usage x listed prices")
            else:
                self.add("openrouter: usage", "FAIL", f"usage cost {usage['cost']} != usage x listed prices {expected}",
                         "the listing and the ledger price differently: check the billing policy")
        if hidden:
            self.add("openrouter: settings", "WARN", "prices, keep-alives and early 429s not compared with the settings: "
                     "the server shows them only to the admin (gateway on)", "rerun with --admin-key")
            return
        if not settings.get("sse_keepalive_s"):
            self.add("openrouter: keep-alives", "WARN", "sse_keepalive_s=0: long silent streams (queue, prefill, "
                     "reasoning) send nothing", "set sse_keepalive_s (e.g. 10): the aggregator may cancel idle streams")
        if not settings.get("max_queue_wait_s"):
            self.add("openrouter: early 429s", "WARN", "max_queue_wait_s=0: overload queues requests instead of "
                     "answering 429", "set max_queue_wait_s (needs the gateway) so the aggregator can fail over")

    def check_admin(self) -> None:
        if not self.settings().get("gateway"):
            return
        anonymous = self.http.get("/qwen_ext/admin/keys")
        if anonymous.status_code == 404:  # admin_key empty: the admin routes are off (gateway/admin.py)
            if self.admin_key:
                self.add("gateway: admin routes", "FAIL", "the admin routes are disabled (404), yet --admin-key was "
                         "given", "set the server's admin_key setting, or manage keys with `python -m "
                         "qwen_vllm_ext.keys` on the key store")
            else:
                self.add("gateway: admin routes", "PASS", "disabled (404: admin_key not set); keys are managed with "
                         "`python -m qwen_vllm_ext.keys`")
        elif anonymous.status_code != 401:
            self.add("gateway: admin routes", "FAIL", f"/qwen_ext/admin/keys without the admin key: "
                     f"{anonymous.status_code}", "set admin_key; never expose the admin routes without it")
        elif not self.admin_key:
            self.add("gateway: admin routes", "PASS", "closed without the admin key (401); --admin-key not given")
        else:
            ok = self.http.get("/qwen_ext/admin/keys", headers={"Authorization": f"Bearer {self.admin_key}"})
            if ok.status_code == 200:
                self.add("gateway: admin routes", "PASS", f"401 without the admin key, 200 with it "
                         f"({len(ok.json().get('data', []))} keys)")
            else:
                self.add("gateway: admin routes", "FAIL", f"the given admin key got {ok.status_code}",
                         "check --admin-key against the server's admin_key setting")

    def check_ledger(self) -> None:
        if not self.settings().get("ledger"):
            self.add("ledger", "WARN", "usage ledger off: no durable per-request records", "ledger=true (default)")
            return
        deadline, drift = time.time() + 15, None
        while time.time() < deadline:  # the ledger totals gauge refreshes every few seconds
            self.refresh_metrics()
            engine = sum(self.metric_sum(n) or 0 for n in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total"))
            ledger = self.metric_sum("qwen_ext_ledger_instance_tokens")
            running = sum(self.metric_sum(n) or 0 for n in ("vllm:num_requests_running", "vllm:num_requests_waiting"))
            if ledger is not None and running == 0:
                drift = engine - ledger
                if drift == 0:
                    break
            time.sleep(1)
        records = self.metric_sum("qwen_ext_ledger_records_total") or 0
        if drift == 0:
            self.add("ledger", "PASS", f"{records:.0f} records; ledger totals = engine counters ({engine:.0f} tokens, "
                     "drift 0)")
        elif drift is None:
            self.add("ledger", "WARN", "could not compare (no qwen_ext_ledger_instance_tokens, or the engine never "
                     "idle)", "rerun when the server is quiet; `python -m qwen_vllm_ext.usage reconcile` is exact")
        else:
            self.add("ledger", "FAIL", f"engine - ledger = {drift:.0f} tokens with nothing in flight",
                     "records were lost or double counted: `python -m qwen_vllm_ext.usage reconcile --url ...`, "
                     "spill files in data_dir")


def render(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        line = f"{c.status:<4}  {c.name:<{width}}  {c.seen}"
        if c.fix:
            line += f"\n      {'':<{width}}  -> {c.fix}"
        lines.append(line)
    fails = sum(c.status == "FAIL" for c in checks)
    warns = sum(c.status == "WARN" for c in checks)
    lines.append(f"{len(checks)} checks: {fails} FAIL, {warns} WARN")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m qwen_vllm_ext.doctor",
        description="Check a running qwen-vllm-ext server from the outside, as an operator would after a deploy: one "
                    "line per check (PASS / WARN / FAIL, what was seen, what to do); exit status 1 on any FAIL. The "
                    "probes are a few short chat requests (a ~200-word prompt, at most 8 output tokens each).")
    parser.add_argument("--url", required=True, help="the server, e.g. http://localhost:8000")
    parser.add_argument("--api-key", help="a key for the probes (gateway on); a suspended key is reported as such, "
                        "with the command that lifts it")
    parser.add_argument("--admin-key", default=os.environ.get("QWEN_VLLM_EXT_ADMIN_KEY") or None,
                        help="the admin key (checks that the admin routes take it and refuse others); default: the "
                        "environment variable QWEN_VLLM_EXT_ADMIN_KEY, which unlike a flag does not show in `ps`")
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")
    parser.add_argument("--timeout", type=float, default=120.0, metavar="SECONDS",
                        help="per HTTP request, in seconds (default: 120)")
    args = parser.parse_args(argv)
    checks = Doctor(args.url, args.api_key, args.admin_key, args.timeout).run()
    if args.json:
        print(json.dumps([dataclasses.asdict(c) for c in checks], indent=2))
    else:
        print(render(checks))
    return 1 if any(c.status == "FAIL" for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
