"""The ONE settings object of qwen-vllm-ext.

Sources, lowest to highest precedence:

1. defaults (below; each serves most users),
2. environment variables ``QWEN_VLLM_EXT_<FIELD>`` (e.g. ``QWEN_VLLM_EXT_DATA_DIR``),
3. vLLM's ``--additional-config '{"qwen_vllm_ext": {...}}'``,
4. the launcher's own flags ``--qwen-<field>`` (e.g. ``--qwen-data-dir``).

The launcher resolves them once and exports the result as JSON in ``QWEN_VLLM_EXT_SETTINGS``, so every
process vLLM spawns (API servers, engine core, workers) sees the same settings; a process started
without the launcher (plain ``vllm serve`` with the plugin installed) resolves from the environment.
Pure Python: no vLLM import.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Mapping
from typing import Any

from .scheduling.policy import SCHEDULER_MODES, SETTING_PREFIX, PolicyConfig, PolicyError

ENV_PREFIX = "QWEN_VLLM_EXT_"
NESTED_POLICY = "scheduler"  # the Settings field holding the scheduler policy (settings sched_*)
RESOLVED_ENV = "QWEN_VLLM_EXT_SETTINGS"
_CURRENT: tuple[tuple, Any] | None = None  # Settings.current(): (the environment it was resolved from, settings)
ADDITIONAL_CONFIG_KEY = "qwen_vllm_ext"


SECRET_FIELDS = ("gateway_secret", "admin_key", "metrics_key", "spike_webhook")
URL_FIELDS = ("ledger_redis_url", "limiter_redis_url")


REASONING_FIELDS = ("reasoning", "reasoning_content", "both")


class SettingsError(ValueError):
    """A setting has an unknown name or a value of the wrong type."""


def _default_data_dir() -> str:
    home = os.environ.get("QWEN_VLLM_EXT_HOME", os.path.join(os.path.expanduser("~"), ".cache", "qwen-vllm-ext"))
    return os.path.join(home, "data")


@dataclasses.dataclass(frozen=True)
class Settings:
    """Every knob of the extension. Field docs are the settings reference (README)."""

    enabled: bool = True
    """Master switch: with false the plugin loads but changes nothing in vLLM."""
    data_dir: str = dataclasses.field(default_factory=_default_data_dir)
    """Directory for the extension's durable state (usage ledger, keys)."""
    allow_unsupported_vllm: bool = False
    """Apply runtime patches even on a vLLM version they were not written for (at your own risk)."""
    strict_patches: bool = False
    """Fail startup when a runtime patch's vLLM targets do not match their fingerprints (default: disable that
    patch with one log line, shown on the health route)."""

    # ---- usage ---------------------------------------------------------------------------------
    per_chunk_usage: bool = True
    """Every streamed chunk carries cumulative usage (with cached tokens and billing); false = vLLM's stock behaviour."""
    reasoning_field: str = "both"
    """The field a chat response carries thinking in: ``reasoning`` (vLLM's name, OpenRouter's), ``reasoning_content``
    (DeepSeek's and DashScope's, which LiteLLM and many SDK clients read) or ``both`` (the same text under each name,
    message and stream delta). Written by the per_chunk_usage layer: with per_chunk_usage=false responses are vLLM's
    own (``reasoning`` only)."""
    billing_policy: str = "default"
    """Billing policy preset of qwen_v3_calculator used for ``usage.billing`` and the ledger."""
    ledger: bool = True
    """Record one ledger entry per request (durably, before the response completes)."""
    ledger_backend: str = "sqlite"
    """``sqlite`` (a file in data_dir; several API-server processes share it) or ``redis`` (several replicas)."""
    ledger_redis_url: str = ""
    """Redis URL for ``ledger_backend=redis``, e.g. ``redis://127.0.0.1:6379/0``."""
    price_prompt: str = ""
    """USD per million uncached prompt tokens, a plain decimal (``"0.15"``, at most 6 decimals); with any price set,
    usage carries ``cost`` and the ledger records each request's cost in exact pico-dollars. Empty: no prices."""
    price_completion: str = ""
    """USD per million generated tokens (reasoning included), as ``price_prompt``."""
    price_cache_read: str = ""
    """USD per million prompt tokens read from the prefix cache; empty: the prompt price. OpenRouter routes a
    conversation back to the same provider (sticky cache routing) only when this is below the prompt price."""
    price_request: str = ""
    """USD per request the engine worked on (not charged for rejected requests), a plain decimal."""
    access_log: str = ""
    """Path of the stratified JSON-lines access log (empty: off)."""
    access_log_slow_s: float = 5.0
    """Latency above which a successful response is "slow" in the access log."""
    access_log_slow_rate: float = 0.1
    """Sampling rate of slow successful responses (responses with status >= 400 are always logged)."""
    access_log_rate: float = 0.01
    """Sampling rate of the other responses."""

    # ---- scheduling ----------------------------------------------------------------------------
    token_weighted_scheduler: str = "false"
    """``false``: vLLM's scheduler. ``true``: the token-weighted scheduler (monkeypatch mode: no --scheduler-cls
    needed), its policy ordering the queue always. ``auto``: the same scheduler behind the overload gate — exactly
    vLLM's FCFS decisions until the waiting queue needs more than ``sched_overload_steps`` full steps to start, the
    policy only then (docs/scheduling.md). A profile turns it on only where the evidence says never worse."""
    scheduler: PolicyConfig = dataclasses.field(default_factory=PolicyConfig)
    """The token-weighted policy (``qwen_vllm_ext.scheduling.policy.PolicyConfig``): each of its fields ``f`` is
    the setting ``sched_f`` (``QWEN_VLLM_EXT_SCHED_F``, ``--qwen-sched-f``), defined and documented there once."""

    # ---- gateway -------------------------------------------------------------------------------
    gateway: bool = False
    """In-server gateway: scoped API keys, RPM/TPM limits, budgets, rate-limit headers (keys: ``python -m qwen_vllm_ext.keys``)."""
    gateway_secret: str = ""
    """Server secret for key hashes (HMAC-SHA256); empty: generated once and kept in data_dir (or in Redis)."""
    admin_key: str = ""
    """Bearer token for the ``/qwen_ext/admin/keys`` endpoints; empty: admin endpoints disabled."""
    metrics_key: str = ""
    """Scrape credential of ``/metrics`` with the gateway on: set, ``/metrics`` answers only ``Authorization: Bearer
    <metrics_key>`` (or the ``admin_key``; else 401) and carries the per-key series (``qwen_ext_top_key_tokens``,
    ``qwen_ext_top_key_rejections`` by ``key_id``); empty, ``/metrics`` stays public and those two families have no
    samples (key ids and per-key traffic are not shown to whoever can reach the port). Prometheus sends it with
    ``authorization: {type: Bearer, credentials_file: ...}`` (docs/operating.md). No effect with the gateway off."""
    limiter_backend: str = "sqlite"
    """Limiter state: ``sqlite`` (shared by the API-server processes of one host) or ``redis`` (several replicas)."""
    limiter_redis_url: str = ""
    """Redis URL for ``limiter_backend=redis`` (defaults to ``ledger_redis_url``)."""
    limiter_failure: str = "closed"
    """When the limiter store fails at runtime: ``closed`` (503, nothing admitted unmetered) or ``open`` (admit)."""
    require_shared_state: bool = False
    """This server is one replica of a fleet: refuse to start unless the ledger, the API keys and the limiter live
    in Redis (per-host SQLite would split every limit and the ledger between replicas; ``python -m
    qwen_vllm_ext.fleet`` and deploy/kubernetes set it)."""
    global_rpm: int = 0
    """Requests per minute for the whole server (all keys; 0 = unlimited)."""
    global_tpm: int = 0
    """Tokens per minute for the whole server (all keys; 0 = unlimited)."""
    max_tokens_over_cap: str = "reject"
    """A request whose max_tokens exceeds its key's cap: ``reject`` (400) or ``cap`` (lowered to the cap)."""
    max_body_bytes: int = 8388608
    """Largest request body accepted by the gateway (413 above)."""
    max_n: int = 128
    """Most parallel samples (``n``) one request may ask for behind the gateway (400 above; OpenAI's own bound); a
    key's ``max_n`` lowers it for that key. 0 = no bound."""
    max_sequences_per_request: int = 256
    """Most engine sequences one request may run behind the gateway: ``n`` x its prompts (a completions batch); 400
    above. 0 = no bound."""
    unauthenticated_records_per_s: float = 1.0
    """Ledger records of requests refused for a missing or wrong API key (401), at most this many per second per
    API-server process; every such request is counted in ``qwen_ext_gateway_rejections_total{code="invalid_api_key"}``.
    Their records never carry a client-chosen request or conversation id. 0 = none recorded."""
    spike_factor: float = 10.0
    """Spike breaker (gateway/spike.py): suspend a key whose billed units over 15 minutes exceed this multiple of its
    previous UTC day's 15-minute average, the floor below and what its own rpm/tpm allow, all three (0 = off). Keys
    created exempt (``keys create --no-spike-breaker``) and keys without a full previous day are never checked."""
    spike_min_units: float = 0.0
    """The spike breaker's floor in billed units per 15 minutes; 0 = four requests of the largest size the server
    accepts (its context length at the billing policy's priciest split), so one such request never reaches it."""
    spike_cooldown_s: float = 900.0
    """How long a key stays suspended after a spike (>= 1)."""
    spike_webhook: str = ""
    """URL that receives a JSON POST when a key is suspended (empty: none)."""
    max_queue_wait_s: float = 0.0
    """Capacity 429s: a request whose expected queue wait (the prompt tokens admitted ahead of it and not yet
    started, over the measured rate at which they start) exceeds this gets 429 with ``Retry-After`` at admission,
    before the engine sees it (0 = off; needs the gateway, which counts prompts exactly)."""

    # ---- serving as an aggregator's provider ---------------------------------------------------
    openrouter: bool = False
    """Serve as an OpenRouter provider: ``GET /v1/models?format=openrouter`` lists the served model with its prices;
    start-up refuses a billing policy the listing cannot express (context penalty within the context length,
    surcharges, system exclusion) and a listing that disagrees with the engine."""
    listing_context_length: int = 0
    """Context length the listing publishes (0 = the engine's ``max_model_len``; larger is refused)."""
    listing_max_output: int = 0
    """``max_output_length`` the listing publishes (0 = the context length)."""
    listing_quantization: str = ""
    """Quantization the listing publishes (empty = what the engine runs: its quantization method, else its dtype);
    a value the engine does not run is refused."""
    listing_name: str = ""
    """Display name in the listing (empty = the served model name)."""
    listing_hugging_face_id: str = ""
    """``hugging_face_id`` in the listing (empty = ``--model`` when it is a Hugging Face id, else none)."""
    sse_keepalive_s: float = 0.0
    """Send an SSE comment line (``: keep-alive``) on a streamed response that has had nothing to send for this many
    seconds (queued, long prefill, long reasoning), so proxies and the aggregator do not time it out (0 = off)."""

    # ---- KV-cache reuse across turns -----------------------------------------------------------
    kv_reuse_template: bool = True
    """Serve Qwen3 hybrid-thinking models with the package's prefix-stable ``qwen3-reuse`` chat template, and
    Qwen3.5/3.6 models with ``qwen3.5-reuse`` (earlier turns keep their ``<think>`` blocks and answers as generated,
    so each turn reuses the previous turn's KV cache); false = the model's own."""
    kv_turn_checkpoints: bool = True
    """Hybrid models (Gated DeltaNet + attention, e.g. Qwen3.5/3.6): have vLLM keep each chat request's recurrent
    state where the next turn's prompt diverges (after the last ``<|im_start|>assistant``), so the next turn resumes
    there instead of an older checkpoint; false = vLLM's own checkpoints only."""
    kv_answer_checkpoints: bool = True
    """Hybrid models served with the prefix-stable ``qwen3.5-reuse`` template (``kv_reuse_template``): also keep the
    recurrent state while the answer is generated (every match unit, the newest one per request), so the next turn
    reuses the previous answer too; costs one state copy per 16 generated tokens. Under MTP speculative decoding the
    two newest per request, copied from the verify step's state columns by the model runner (synchronous scheduling
    only). Needs ``kv_turn_checkpoints``; false = no decode states kept."""
    kv_block_copies: bool = True
    """Copy every byte of a KV-cache block that vLLM copies (the copy-on-write of a partial-block prefix hit): vLLM
    0.32/0.33 copies one layer view per tensor address, and under MTP a hybrid model packs an attention layer and a
    Gated DeltaNet layer at one address, so a hit read part of the attention values as zeros and greedy outputs
    diverged from an uncached request. false = vLLM's copy. Also carries the answer checkpoints' state copies under
    speculative decoding (``kv_answer_checkpoints``)."""
    mtp_speculative_tokens: int = 0
    """Multi-token-prediction speculative decoding (Qwen3.5/3.6 and Qwen3-Next checkpoints ship MTP heads): the
    number of draft tokens per step; the launcher passes ``--speculative-config '{"method": "mtp",
    "num_speculative_tokens": N}'`` (your own ``--speculative-config`` wins) and refuses a checkpoint without MTP
    layers. 0 = off, the default in every profile until a GPU run shows it never worse (issue 49)."""
    kv_reuse_tracker_size: int = 10000
    """Conversations whose previous turn each API-server process remembers for the reuse ratio (LRU)."""
    idle_sleep_s: float = 0.0
    """Put the engine to sleep (vLLM sleep mode, GPU only) after this many idle seconds; the next request wakes it (0 = off)."""

    cpu_seeded_sampling: bool = True
    """On the CPU build, a seeded request (``seed``) prefilled in chunks keeps its sampling stream instead of killing
    the engine (vLLM 0.32 rewinds its generator with an offset a CPU generator does not have: ``EngineDeadError``);
    runtime patch of the CPU model runner (``qwen_vllm_ext/sampling/cpu_seeds.py``). false = vLLM's stock behaviour."""

    cpu_spec_decode_kernels: bool = True
    """On the CPU build, speculative decoding (MTP) on a hybrid model with prefix caching: CPU implementations of the
    two fused Triton kernels vLLM launches to move the recurrent states (``qwen_vllm_ext/spec/cpu_mamba_kernels.py``);
    without them the engine dies on the first request. false = vLLM's stock behaviour."""

    # ---- connections (API server; qwen_vllm_ext/gateway/connections.py) ------------------------
    connection_guard: bool = True
    """Protect the API server's sockets from idle and half-open connections (runtime patch of vLLM's uvicorn server):
    the header timeout, the connection cap and the raised open-file limit below; false = uvicorn's stock behaviour
    (a connection that never sends a byte stays open for ever)."""
    header_timeout_s: float = 60.0
    """Close (with 408) a connection that has not sent a complete request head (request line and headers) this many
    seconds after it opened, or after the first byte of its next request on a kept-alive connection; a connection
    busy with a request (a long stream) is never affected (0 = no timeout). 60 s is nginx's
    ``client_header_timeout``: a client whose own process stalls between connecting and sending (a loaded load
    generator stalled 17 s) must not read a 408 for a request it did send; idle floods are handled by the cap."""
    max_connections: int = 0
    """Open HTTP connections per API-server process. Over it, the oldest connection still waiting for its request
    head (at least 1 s old) is closed to make room; when none is, the newcomer gets 503 with ``Retry-After`` (0 = the
    open-file limit minus ``connection_fd_reserve``; a larger value is lowered to that)."""
    connection_fd_reserve: int = 1024
    """File descriptors kept for the server's own use (engine sockets, files, the ledger, 503 answers) when the
    connection cap is derived from the open-file limit (at most half the limit)."""
    raise_fd_limit: bool = True
    """Raise the API server's open-file limit (``RLIMIT_NOFILE`` soft) to its hard limit at start (children inherit it)."""

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def _flat_fields(cls) -> dict[str, tuple[str, Any]]:
        """Setting name -> (type name, default) in declaration order; the nested policy as ``sched_*`` names."""
        out: dict[str, tuple[str, Any]] = {}
        for f in dataclasses.fields(cls):
            if f.name == NESTED_POLICY:
                for p in dataclasses.fields(PolicyConfig):
                    out[SETTING_PREFIX + p.name] = (p.type, p.default)
            else:
                default = f.default_factory() if f.default is dataclasses.MISSING else f.default
                out[f.name] = (f.type, default)
        return out

    @classmethod
    def field_names(cls) -> list[str]:
        """Every setting's name, as users write it (``sched_*`` for the scheduler's)."""
        return list(cls._flat_fields())

    @classmethod
    def _coerce(cls, name: str, value: Any) -> Any:
        fields = cls._flat_fields()
        if name not in fields:
            raise SettingsError(f"unknown setting {name!r}; known settings: {', '.join(fields)}")
        kind = fields[name][0]
        if name == "token_weighted_scheduler":
            text = str(value).strip().lower()
            mode = {"1": "true", "yes": "true", "on": "true", "0": "false", "no": "false", "off": "false"}.get(text, text)
            if mode not in SCHEDULER_MODES:
                raise SettingsError(f"setting 'token_weighted_scheduler' expects {'/'.join(SCHEDULER_MODES)}, got "
                                    f"{value!r}")
            return mode
        if kind == "bool":
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise SettingsError(f"setting {name!r} expects true/false, got {value!r}")
        if kind == "int":
            try:
                return int(value)
            except (TypeError, ValueError):
                raise SettingsError(f"setting {name!r} expects an integer, got {value!r}") from None
        if kind == "float":
            try:
                return float(value)
            except (TypeError, ValueError):
                raise SettingsError(f"setting {name!r} expects a number, got {value!r}") from None
        return str(value)

    @classmethod
    def from_flat(cls, values: Mapping[str, Any]) -> "Settings":
        """Settings from setting names (``sched_*`` included); values are coerced to each setting's type.

        A scheduler value out of range is a :class:`SettingsError` naming the setting: a clear start-up error,
        not a traceback from the engine core when it builds its scheduler."""
        own, policy = {}, {}
        for name, value in values.items():
            value = cls._coerce(name, value)
            if name.startswith(SETTING_PREFIX):
                policy[name[len(SETTING_PREFIX):]] = value
            else:
                own[name] = value
        try:
            scheduler = PolicyConfig(**policy)
        except PolicyError as exc:
            raise SettingsError(f"setting {SETTING_PREFIX + exc.field!r}: {exc}") from None
        settings = cls(**own, scheduler=scheduler)
        settings.prices()  # a price that cannot be billed exactly: refused here, naming the setting
        for name in ("max_queue_wait_s", "sse_keepalive_s", "listing_context_length", "listing_max_output", "max_n",
                     "max_sequences_per_request", "unauthenticated_records_per_s", "spike_factor", "spike_min_units",
                     "mtp_speculative_tokens"):
            if not getattr(settings, name) >= 0 or getattr(settings, name) == float("inf"):  # NaN fails >= too
                raise SettingsError(f"setting {name!r} must be a finite number >= 0, got {getattr(settings, name)}")
        if not 1 <= settings.spike_cooldown_s < float("inf"):
            raise SettingsError(f"setting 'spike_cooldown_s' must be a finite number of seconds >= 1, got "
                                f"{settings.spike_cooldown_s}")
        if settings.reasoning_field not in REASONING_FIELDS:
            raise SettingsError(f"setting 'reasoning_field' must be one of {', '.join(REASONING_FIELDS)}, got "
                                f"{settings.reasoning_field!r}")
        if settings.spike_webhook and not settings.spike_webhook.startswith(("http://", "https://")):
            raise SettingsError(f"setting 'spike_webhook' must be an http(s) URL, got {settings.spike_webhook!r}")
        return settings

    @functools.cached_property
    def billing(self):
        """The billing object (``qwen_v3_calculator.billing.Billing``: policy + prices), built once per settings
        object (and the settings once per process: :meth:`current`) and passed to whatever bills."""
        from qwen_v3_calculator.billing import Billing, get_policy

        return Billing(get_policy(self.billing_policy), self.prices())

    def prices(self):
        """The provider's prices (``qwen_v3_calculator.billing.Prices``), or None when no price is set."""
        if not (self.price_prompt or self.price_completion or self.price_cache_read or self.price_request):
            return None
        from qwen_v3_calculator.billing import Prices

        try:
            return Prices.per_million(self.price_prompt, self.price_completion, self.price_cache_read,
                                      self.price_request, names=("setting 'price_prompt'", "setting 'price_completion'",
                                                                 "setting 'price_cache_read'", "setting 'price_request'"))
        except ValueError as exc:
            raise SettingsError(str(exc)) from None

    def flat(self) -> dict[str, Any]:
        """Every setting by the name users write (``sched_*`` included)."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != NESTED_POLICY}
        data.update({SETTING_PREFIX + k: v for k, v in dataclasses.asdict(self.scheduler).items()})
        return {name: data[name] for name in self.field_names()}

    @classmethod
    def resolve(
        cls,
        env: Mapping[str, str] | None = None,
        additional_config: Mapping[str, Any] | None = None,
        cli: Mapping[str, Any] | None = None,
        base: Mapping[str, Any] | None = None,
    ) -> "Settings":
        """Merge the sources in precedence order (defaults < base < env < additional-config < CLI).

        ``base`` is the launch profile's ``[extension]`` table.
        """
        env = os.environ if env is None else env
        values: dict[str, Any] = {name: cls._coerce(name, value) for name, value in (base or {}).items()}
        for name in cls.field_names():
            key = ENV_PREFIX + name.upper()
            if key in env:
                values[name] = cls._coerce(name, env[key])
        section = (additional_config or {}).get(ADDITIONAL_CONFIG_KEY, {})
        if not isinstance(section, Mapping):
            raise SettingsError(f"--additional-config key {ADDITIONAL_CONFIG_KEY!r} must be a JSON object")
        for name, value in section.items():
            values[name] = cls._coerce(name, value)
        for name, value in (cli or {}).items():
            if value is not None:
                values[name] = cls._coerce(name, value)
        return cls.from_flat(values)

    @classmethod
    def current(cls) -> "Settings":
        """Settings of this process: the launcher's resolved JSON if present, else from the environment. Resolved
        once: later calls return the same (frozen) object while the ``QWEN_VLLM_EXT_*`` environment is unchanged."""
        global _CURRENT
        key = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(ENV_PREFIX)))
        if _CURRENT is None or _CURRENT[0] != key:
            blob = os.environ.get(RESOLVED_ENV)
            _CURRENT = (key, cls.from_flat(json.loads(blob)) if blob else cls.resolve())
        return _CURRENT[1]

    def to_json(self) -> str:
        return json.dumps(self.flat(), sort_keys=True)

    def export(self, environ: dict[str, str] | None = None) -> None:
        """Publish these settings to child processes (they read them with :meth:`current`)."""
        (os.environ if environ is None else environ)[RESOLVED_ENV] = self.to_json()

    def public(self) -> dict[str, Any]:
        """Settings safe to show on the (unauthenticated) health route: secrets masked, URL passwords removed."""
        from .store.redis import safe_url

        data = self.flat()
        for name in SECRET_FIELDS:
            if data[name]:
                data[name] = "***"
        for name in URL_FIELDS:
            data[name] = safe_url(data[name])
        return data
